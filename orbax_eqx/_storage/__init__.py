"""Storage: where array bytes live on disk, and how they are checked.

One folder per layout, each with its writer and its index or format:
`packed/` (unsharded arrays end to end in one pack file), `sharded/` (each
process's distinct shards in a shard pack, with an index), `orbax_store/`
(Orbax's own array store, `pack=False`, with its reader), `typed/` (the
files of one `serialize` call of the pack's Orbax type handler), `shared/`
(the packs and shard packs that a manager's steps share with `dedup=True`,
and their clean-up). Every
ranged read goes through one engine (`engine`: units made of pieces of
files, read, checked, placed; `put`: arrays of them on devices), the
state_dict bridge's too; `read` makes packed and shard-packed leaves its
units. The way bytes cross between host and devices is `transfer/` (host
copies for a save, the staging window, streaming a large leaf into a buffer
on its device). `ranges`: byte ranges of one file, written and read with
pwritev/preadv; where records go. The checksums are the format's
(`_format.checksum`).

No layout imports another; `typed/`, `read` and `put` sit over the layouts
and the engine, `ranges` and `transfer` under them (import-linter's "storage"
contract in pyproject.toml). Nothing here runs a computation over a
sharded array; the only computations are on one device's own data (small
arrays stacked before one copy to host, a large leaf streamed into a buffer on
its device).
May import: `_format`, `_tree`, `_bytes`, `_errors`.
"""
