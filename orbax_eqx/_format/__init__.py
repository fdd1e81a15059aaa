"""The format: what a checkpoint's item directory holds, and its sidecar.

Owns the on-disk file names and format version and building the sidecar
(`sidecar`), the checksums of array bytes and of JSON files (`checksum`),
short records (`compact`, with the paths names read as: `paths`), the
sidecar's bytes and seal (`sealed`, written by `sidecar_write`), its records
as declarative schemas (`schema`), reading it (`sidecar_read`), and finding
the item directory from a path a user gives (`locate`). Reading a sidecar
never imports or executes anything named in it.
May import: `_tree`, `_errors`, and `_bytes` (opening files safely).
"""
