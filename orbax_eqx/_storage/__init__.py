"""Storage: where array bytes live on disk, and how they are checked.

One folder per layout, each with its writer, its index or format, and its
reader: `packed/` (unsharded arrays end to end in one pack file), `sharded/`
(each process's distinct shards in a shard pack, with an index), `orbax_store/`
(Orbax's own array store, `pack=False`), `typed/` (the files of one
`serialize` call of the pack's Orbax type handler), and `staged/` (restores of
packed and shard-packed leaves through a bounded staging window). The way
bytes cross between host and devices is `transfer/` (host copies for a save,
the staging window, streaming a large leaf into a buffer on its device).
What several of them share: `ranges` (byte ranges of one file, written and
read with pwritev/preadv; where records go) and `boxes` (target boxes made of
stored boxes). The checksums are the format's (`_format.checksum`).

No layout imports another; `staged/` and `typed/` sit over the layouts, and
`boxes`, `ranges` and `transfer` under them (import-linter's
"storage" contract in pyproject.toml). Nothing here runs a computation over a
sharded array; the only computations are on one device's own data (small
arrays stacked before one copy to host, a large leaf streamed into a buffer on
its device).
May import: `_format`, `_tree`, `_bytes`, `_errors`.
"""
