"""Storage: where array bytes live on disk, and how they are checked.

Owns pack files (`packfile`: aligned records written and read with
pwritev/preadv; `packing`: which arrays go there and where), shard packs
(`shards`: per-process files of sharded arrays' chunks with their index),
typed groups (`typed`, `typed_read`: the files of one `serialize` call of the
pack's Orbax type handler), checksums (`checksum`), arrays kept in Orbax's own
store (`stored_read`, `stored_check`), opening files safely (`files`: only
regular files, never blocking, bounded reads; new files never through a
planted link), and the way bytes cross between host and devices: host copies
for a save (`to_host`), restores through a bounded staging window (`staging`,
`staged_plan`, `staged_read`, `streaming`). Nothing here runs a computation
over a sharded array; the only computations are on one device's own data
(small arrays stacked before one copy to host, a large leaf streamed into a
buffer on its device).
May import: `_format`, `_tree`, `_errors`.
"""
