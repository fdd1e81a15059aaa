"""Packed layout: unsharded arrays end to end in one pack file per save.

May import: `_storage.ranges`, `_storage.transfer`, `_format`, `_tree`,
`_bytes`, `_errors`; never another layout.
"""
