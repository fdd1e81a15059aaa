"""Orbax's own array store (`pack=False`): arrays written by Orbax itself.

Owns opening the store and which of a save's arrays it still holds (`keys`,
the one module the save imports), checking the store's metadata against the
sidecar before a restore (`check`), which files may be in the store directory
(`files`), and reading arrays back with their sums (`read`).
May import: `_storage.transfer`, `_format`, `_tree`,
`_bytes`, `_errors`; never another layout.
"""
