"""Staged restores: leaves read through a bounded window of host memory.

Owns the plan of a staged restore (`plan`: leaves, steps and slabs) and its
reading (`read`), for packed and shard-packed leaves alike.
May import: `_storage.ranges`, `_storage.transfer`, `_storage.checksum`,
`_format`, `_tree`, `_errors`.
"""
