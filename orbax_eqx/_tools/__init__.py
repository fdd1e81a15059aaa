"""Tools: the command line and what it runs.

Owns `python -m orbax_eqx` (`cli`), the demo, `inspect`, `diff`, `verify`,
`export` and `import` (each with a `*_text` module for its printed output
where it has one), safetensors files, progress lines and text tables.
May import: everything else in the package; nothing imports `_tools` except
`orbax_eqx/__init__.py` (for `verify`) and `__main__.py`.
"""
