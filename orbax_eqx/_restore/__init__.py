"""Restoring: a skeleton checked against the sidecar, then arrays read into it.

Owns the skeleton checks (`check`), which leaves to read (`select`, `renames`,
`rename_map`), target shardings (`shardings`, `rules`), reading arrays and
rebuilding the tree (`restore`), reading batches of leaves for tools (`read`)
and falling back past damaged steps (`fallback`).
May import: `_storage`, `_format`, `_tree`, `_errors`.
"""
