"""Tools: the command line and what it runs.

Owns `python -m orbax_eqx` (`cli`; `cli_commands` for `inspect`, `diff`,
`verify` and `demo`, `cli_safetensors` for `export` and
`import`), the demo, `inspect`, `diff`, `verify`, `export` and `import` (thin
layers over the state_dict bridge, `_bridge`; each command with a `*_text`
module for its printed output where it has one), progress lines and text
tables; what a path names, whoever wrote its items (`step_items`), plain
Orbax checkpoints (`plain_items`, read through TensorStore by `plain_read`,
shown by `plain_text`), `diff` of steps item by item (`diff_items`), and the
numbers of `inspect --params` / `--stats` (`params`, `stats`, `numbers_text`).
May import: everything else in the package; nothing imports `_tools` except
`orbax_eqx/__init__.py` (for `verify`) and `__main__.py`.
"""
