"""Sharded layout: each process's distinct shards in a shard pack of its own.

Owns the shard packs' writer (`write`), their index format (`index`), the
indexes read and checked against the sidecar (`index_read`); they are read
through the engine (`_storage.read`).
May import: `_storage.ranges`, `_storage.transfer`,
`_format`, `_tree`, `_bytes`, `_errors`; never another
layout.
"""
