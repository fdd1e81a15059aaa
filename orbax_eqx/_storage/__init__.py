"""Storage: where array bytes live on disk, and how they are checked.

One folder per layout (`packed/`, `sharded/`, `orbax_store/`; `typed/` over
them); `shared/` for `dedup=True`; one ranged-read engine (`engine`, `put`)
that `read` and the state_dict bridge feed; `transfer/` between host and
devices; `ranges`: byte ranges of one file. No layout imports another
(import-linter's "storage" contract). Nothing here computes over a sharded
array, only on one device's own data.
May import: `_format`, `_tree`, `_bytes`, `_errors`.
"""
