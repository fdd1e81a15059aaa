"""Typed groups: the files of one `serialize` call of the pack's type handler.

Owns a group's writer and index format (`write`) and its reader (`read`). A
group is a pack and shard packs with an index of its own, so this sits over
the layouts: it writes and reads through `packed` and `sharded`.
May import: `_storage.packed`, `_storage.sharded`, `_storage.ranges`,
`_storage.transfer`, `_format`, `_tree`, `_bytes`,
`_errors`.
"""
