"""Packed layout: unsharded arrays end to end in one pack file per save.

Owns which arrays are packed and the pack written with each leaf's checksum
(`write`), and reading wanted leaves back, checked, as arrays (`read`).
May import: `_storage.ranges`, `_storage.transfer`,
`_format`, `_tree`, `_bytes`, `_errors`; never another layout.
"""
