"""Typed groups: the files of one `serialize` call of the pack's type handler.

A group is a pack and shard packs with an index of its own, so this sits over
the layouts. May import: `_storage.packed`, `_storage.sharded`,
`_storage.ranges`, `_storage.transfer`, `_format`, `_tree`, `_bytes`,
`_errors`.
"""
