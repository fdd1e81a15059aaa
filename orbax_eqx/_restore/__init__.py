"""Restoring: a skeleton checked against the sidecar, then arrays read into it.

Owns the skeleton checks (`check` collects differences, and words them,
with `classes` saying why classes differ and
`wide` keeping 64-bit arrays from being narrowed), which leaves to read
(`select`, `renames`), target shardings (`shardings`, `rules`),
reading arrays and rebuilding the tree (`restore`), reading batches of leaves
for tools (`read`), telling a checkpoint deleted during a restore (`vanished`)
and falling back past damaged or deleted steps, never past a failing store
(`fallback`).
May import: `_bytes`, `_storage`, `_format`, `_tree`, `_errors`.
"""
