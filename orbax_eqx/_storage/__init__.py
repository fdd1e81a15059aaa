"""Storage: where array bytes live on disk, and how they are checked.

Owns pack files (`packfile`: aligned records written and read with
pwritev/preadv; `packing`: which arrays go there and where), shard packs
(`shards`: per-process files of sharded arrays' chunks with their index),
typed groups (`typed`, `typed_read`: the files of one `serialize` call of the
pack's Orbax type handler), checksums (`checksum`), arrays kept in Orbax's own
store (`stored_read`, `stored_check`), and opening files safely (`files`: only
regular files, never blocking, bounded reads; new files never through a
planted link). Nothing here runs a computation on a device.
May import: `_format`, `_tree`, `_errors`.
"""
