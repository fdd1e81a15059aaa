"""Orbax's own array store (`pack=False`): arrays written by Orbax itself.

Owns reading them back with their sums (`read`), checking the store's
metadata against the sidecar (`check`), and which files may be in the store
directory (`files`).
May import: `_storage.checksum`, `_format`, `_tree`, `_bytes`, `_errors`.
"""
