"""Where bytes go: local files and object stores behind one small interface.

`_format` and `_storage` decide what is stored; this package only where:
`store` (the interface), `route`, `local` (via `files`: regular files only,
never through a planted link), `objects` (`gs://`, `s3://` through
TensorStore), `damage` (bad bytes are read again before they are damage; a
store's failure is never damage).
May import: `_errors` only (every stage above may use it).
"""
