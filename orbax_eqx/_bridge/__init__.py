"""The state_dict bridge: Equinox trees ⇄ PyTorch / Hugging Face tensor layouts,
through the mapping (`_mapping`): in memory (`memory`), loading safetensors
onto any sharding by ranged reads (`load`, `load_check`; the reads through
`_storage.engine`), exporting with bounded memory (`export`, `export_source`,
`export_files`), and the safetensors format itself (`safetensors/`).
May import: `_mapping`, `_restore`, `_storage`, `_format`, `_tree`, `_bytes`,
`_errors`; not `_orbax`."""
