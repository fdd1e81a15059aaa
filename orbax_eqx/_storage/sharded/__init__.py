"""Sharded layout: each process's distinct shards in a shard pack of its own.

May import: `_storage.ranges`, `_storage.transfer`, `_format`, `_tree`,
`_bytes`, `_errors`; never another layout.
"""
