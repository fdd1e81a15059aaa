"""Rebuilding a saved tree without a skeleton, importing only what is allowed.

Owns the `allow=` list and looking names up under it (`allow`: the one place
that imports anything, and only the modules `allow` names), recorded values
made real (`decode`: static fields, dict keys, callables, numpy scalars
checked before they are made, stand-ins for saved arrays), `eqx.nn.Shared`'s
selectors through recorded nodes only (`shared`), and turning the sidecar's
records back into a skeleton of the real classes (`build`), every leaf or
module that cannot be rebuilt said in one `RebuildError`.
May import: `_format`, `_tree`, `_errors`, and `_restore.wide` (which
container an array restores as without a skeleton).
"""
