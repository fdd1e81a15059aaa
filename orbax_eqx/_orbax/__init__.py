"""The Orbax face: handlers and the standalone functions built on them.

Owns the v0 `EqxHandler` (`handler`) with its `EqxSave` / `EqxRestore` args
(`args`, registered in `handler`), the v1 checkpointable handler registered
on import (`v1`), standalone `save` / `restore` / `metadata` (`api`, its
options typed by `options`), and the pack as an Orbax
`TypeHandler` for Orbax's own handlers (`type_handler`, its restores
`type_restore`, its local registry `type_registry`), and restoring plain
Orbax checkpoints of Equinox models into skeletons (`plain`), and restores
that rebuild the saved tree under `allow=` (`rebuilt`).
May import: `_save`, `_restore`, `_rebuild`, `_storage`, `_format`, `_tree`,
`_bytes`, `_errors`, `_gc`; never `_bridge` or `_tools`, which sit above it.
"""
