"""The format: what a checkpoint's item directory holds, and its sidecar.

Owns the on-disk file names and format version, the checksums of array
bytes and of the sidecar (`checksum`: the one place they are computed),
writing the sidecar (`sidecar`), its bytes and their checksum (`sealed`),
what each record may hold as declarative schemas per format version
(`schema`), reading it (`sidecar_read`, its records in `records_read`) and
finding the item
directory from a path a user gives (`locate`). Reading a sidecar never imports
or executes anything named in it.
May import: `_tree`, `_errors`, `_gc` (pausing the garbage collector while
records are parsed), and of `_bytes` only `store` (opening files safely).
"""
