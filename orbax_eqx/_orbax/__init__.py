"""The Orbax face: handlers and the standalone functions built on them.

Owns the v0 `EqxHandler` (`handler`) with its `EqxSave` / `EqxRestore` args
(`args`), the v1 checkpointable handler registered on import (`v1`),
standalone `save` / `restore` / `metadata` (`api`), the pack as an Orbax
`TypeHandler` with its local registry (`type_handler`, its restores
`type_restore`), plain Orbax checkpoints (`plain`: restored into skeletons,
listed and read for the tools), restores that rebuild the saved tree under
`allow=` (`rebuilt`), `verify`, and what a path names for it and the command
line (`items`).
May import: `_save`, `_restore`, `_rebuild`, `_storage`, `_format`, `_tree`,
`_bytes`, `_errors`, `_gc`; never `_bridge` or `_cli`, which sit above it.
"""
