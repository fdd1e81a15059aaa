"""Packed layout: unsharded arrays end to end in one pack file per save.

Owns which arrays are packed and the pack written with each leaf's checksum
(`write`); it is read through the engine (`_storage.read`).
May import: `_storage.ranges`, `_storage.transfer`,
`_format`, `_tree`, `_bytes`, `_errors`; never another layout.
"""
