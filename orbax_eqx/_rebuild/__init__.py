"""Rebuilding a saved tree without a skeleton, importing only what is allowed.

Owns the `allow=` list and looking names up under it (`allow`: the one place
that imports anything a sidecar names), and turning the sidecar's records of
nodes and leaves back into a skeleton of the real classes (`build`), which a
restore then fills like any other skeleton.
May import: `_format`, `_tree`, `_errors`, and `_restore.wide` (which
container an array restores as without a skeleton).
"""
