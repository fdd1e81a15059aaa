"""The state_dict bridge: Equinox trees ⇄ PyTorch / Hugging Face tensor layouts.

Owns the mapping between leaf names and another layout's tensor names
(`mapping.StateDictMapping`: a list of small rules in `transforms/`, one
transformation a file with its inverse beside it: renames, regex renames,
per-field keys from `eqx.field(metadata=...)`, stacking a leading layer axis,
axis permutations, split/fuse along an axis, a dtype per tensor, dropping,
ignoring and tying; `templates` and `safe_regex` bound what a rule's names
and patterns may cost), the planner that runs the rules over both sides'
shapes into `pieces.Piece`s (`plan`, with `stage` carrying the tensors in the
making and `report` wording the problems), the leaves of a tree as the
planner sees them (`leaves`), the in-memory `to_state_dict` /
`from_state_dict` (`memory`), loading
safetensors (local, `gs://`, `s3://`) straight onto any sharding by ranged
reads (`load`, its checks in `load_check`, the reads in `fill`), and
exporting a tree or a checkpoint to safetensors with bounded memory
(`export`, what it reads in `export_source`, where its files go in
`export_files`); the safetensors format itself (`safetensors/`: headers,
index files, dtypes, writing), sidecar records and PRNG keys as the file
side sees them (`specs`), and progress hooks (`progress`).
May import: `_restore` (reading a checkpoint's leaves), `_storage`, `_format`,
`_tree`, `_bytes`, `_errors`; not `_orbax`, a stage beside it (the CLI's
`import` saves through `_orbax` itself). Nothing imports `_bridge` except
`orbax_eqx/__init__.py` and `_cli` (the CLI's `export` / `import`, thin
layers over it, and its dry run `inspect --skeleton`).
"""
