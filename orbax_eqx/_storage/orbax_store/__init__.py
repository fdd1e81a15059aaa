"""Orbax's own array store (`pack=False`): arrays written by Orbax itself.

Owns `keys` (the one module the save imports), `check`, `files` and `read`.
May import: `_storage.transfer`, `_format`, `_tree`, `_bytes`, `_errors`;
never another layout.
"""
