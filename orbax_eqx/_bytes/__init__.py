"""Where bytes go: local files and object stores behind one small interface.

The format code (`_format`, `_storage`) decides what is stored: pack files,
shard packs and their indexes, the sidecar, typed groups. This package
decides where the bytes of each go, and owns nothing of their meaning:

- `paths`: whether a path is local or an object (`is_remote`), asked nowhere
  else;
- `store`: the interface (`Store`: whole files, streamed writes of large
  files, ranged reads with their checks) only; `route.for_path` picks the
  implementation from a path once;
- `local`: local files (`pwritev`/`preadv`, `O_EXCL|O_NOFOLLOW`, fsync,
  rename), through `files`, which opens only regular files, never blocking;
- `objects`: `gs://` and `s3://` through TensorStore's kvstore (concurrent
  requests, retries, credentials), large files as parts of bounded size;
  its ranged reads in `object_reads`, and on S3 in `s3_reads` (botocore,
  straight into the buffers);
- `verdict`: the one place that decides whether a read that went wrong is
  the file's damage or the store's failure, and what is read again; one
  request's tries and the words of its failure in `tries`;
  `patience`: how long a request may stall, how often it is tried;
- `endpoints`: which bucket, endpoint, region and credentials a path means,
  from each ecosystem's standard environment;
- `parts`: how a large file is cut into objects, shared by both stores so
  that either reads a checkpoint the other wrote (copied up or down whole).

May import: `_errors` only (every stage above may use it).
"""
