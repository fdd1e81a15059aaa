"""The Orbax face: handlers and the standalone functions built on them.

Owns the v0 `EqxHandler` (`handler`) with its `EqxSave` / `EqxRestore` args
(`args`, registered in `handler`), the v1 checkpointable handler registered
on import (`v1`), standalone `save` / `restore` / `metadata` (`api`, its
options typed by `options`), and the pack as an Orbax
`TypeHandler` for Orbax's own handlers (`type_handler`, its restores
`type_restore`, its local registry `type_registry`), and restoring plain
Orbax checkpoints of Equinox models into skeletons (`plain`), and restores
that rebuild the saved tree under `allow=` (`rebuilt`); and `verify`
(`verify`: every array read back and checked), with what a path names for it
and the command line (`items`: orbax_eqx, type-handler and plain Orbax
items, steps and roots), plain Orbax items' metadata (`plain_items`) and
their arrays read a block at a time (`store_read`).
May import: `_save`, `_restore`, `_rebuild`, `_storage`, `_format`, `_tree`,
`_bytes`, `_errors`, `_gc`; never `_bridge` or `_cli`, which sit above it.
"""
