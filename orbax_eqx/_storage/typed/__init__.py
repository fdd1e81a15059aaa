"""Typed groups: the files of one `serialize` call of the pack's type handler.

Owns a group's writer and index format (`write`) and its reader (`read`).
May import: `_storage.ranges`, `_storage.checksum`, `_format`, `_tree`,
`_bytes`, `_errors`.
"""
