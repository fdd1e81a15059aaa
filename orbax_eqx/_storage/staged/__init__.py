"""Staged restores: leaves read through a bounded window of host memory.

Owns the plan of a staged restore (`plan`: leaves, jobs and slabs) and its
reading (`read`). Its jobs mix packed and shard-packed leaves, so this sits
over the layouts: it reads shard packs' indexes and checks their chunks as
`sharded` does.
May import: `_storage.sharded`, `_storage.boxes`, `_storage.ranges`,
`_storage.transfer`, `_format`, `_tree`, `_errors`.
"""
