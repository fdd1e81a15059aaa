"""The command line: `python -m orbax_eqx COMMAND` (or `orbax-eqx COMMAND`).

`main` holds the arguments and the one error handler; each command is a
module of its own (`inspect` with `stats` for `--params`/`--stats` and
`safetensors_files` for safetensors, `diff`, `verify`, `export`, `import_`,
`demo`); `render` is the one place text is made (tables, the tree of a
checkpoint, errors, progress bars); `skeleton` imports `module:function`.
May import: everything else in the package; nothing imports `_cli` but
`__main__.py` (and the `orbax-eqx` script).
"""
