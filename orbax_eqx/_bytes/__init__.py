"""Where bytes go: local files and object stores behind one small interface.

The format code (`_format`, `_storage`) decides what is stored: packs, shard
packs and their indexes, the sidecar. This package decides where their bytes
go, and owns nothing of their meaning:

- `store`: the interface (`Store`, `Reader`, `Reads`, `BadFile`), and how a
  large file is cut into objects, the same on both stores;
  `route.for_path` picks the implementation from a path once, and
  `route.is_remote` says which side a path is on;
- `local`: local files (`pwritev`/`preadv`, fsync, rename), opened through
  `files` (regular files only, never blocking, never through a planted link);
- `objects`: `gs://` and `s3://` through TensorStore's kvstore, its retries
  configured, endpoints and credentials from each ecosystem's environment;
- `damage`: bytes from an object store that fail their checks are read again
  before they are called damage, and a store's failure is never damage.

May import: `_errors` only (every stage above may use it).
"""
