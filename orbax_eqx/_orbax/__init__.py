"""The Orbax face: handlers and the standalone functions built on them.

Owns the v0 `EqxHandler` with its `EqxSave` / `EqxRestore` args (`handler`),
the v1 checkpointable handler registered on import (`v1`) and standalone
`save` / `restore` / `metadata` (`api`).
May import: `_save`, `_restore`, `_storage`, `_format`, `_tree`, `_errors`.
"""
