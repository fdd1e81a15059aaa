"""The format: what a checkpoint's item directory holds, and its sidecar.

Owns the on-disk file names and format version, writing the sidecar
(`sidecar`), its bytes and their checksum (`sealed`), reading and validating
it (`sidecar_read`) and finding the item
directory from a path a user gives (`locate`). Reading a sidecar never imports
or executes anything named in it.
May import: `_tree`, `_errors`, `_gc` (pausing the garbage collector while
records are parsed), of `_bytes` only `store` (opening files
safely), and of `_storage` only `checksum` (the one place checksums are
computed): each imports nothing of ours but `_errors`.
"""
