"""Packed layout: unsharded arrays end to end in one pack file per save.

Owns which arrays are packed and where (`read`: the pack's layout, the host
copies of a save, reading records back and checking their sums).
May import: `_storage.ranges`, `_storage.transfer`, `_storage.checksum`,
`_format`, `_tree`, `_bytes`, `_errors`; never another layout.
"""
