"""The Orbax face: handlers and the standalone functions built on them.

Owns the v0 `EqxHandler` with its `EqxSave` / `EqxRestore` args (`handler`),
the v1 checkpointable handler registered on import (`v1`), standalone
`save` / `restore` / `metadata` (`api`), and the pack as an Orbax
`TypeHandler` for Orbax's own handlers (`type_handler`, its restores
`type_restore`, its local registry `type_registry`), and restoring plain
Orbax checkpoints of Equinox models into skeletons (`plain`), and restores
that rebuild the saved tree under `allow=` (`rebuilt`).
May import: `_save`, `_restore`, `_rebuild`, `_storage`, `_format`, `_tree`,
`_bytes`, `_errors`; never `_bridge` or `_tools`, which sit above it.
"""
