"""The safetensors format: headers, index files, dtypes, and writing files.

A safetensors file is an 8-byte little-endian header length, a JSON header
(`{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}`),
then the tensors' C-order bytes, back to back, in the order of their
offsets. A sharded set is files in one directory named by a
`model.safetensors.index.json` (`{"weight_map": {tensor: file}}`).

- `dtypes`: the format's dtype codes, an allow list, and their numpy dtypes;
- `header`: reading and checking one file's header, on a disk or an object
  store (bounded, offsets inside the file, names and codes allowed);
- `index`: finding the files of a source (a file, a directory with or
  without an index, a list of files) and checking the index;
- `write`: writing files (headers, tensors at their offsets, under temporary
  names), checked with the `safetensors` library's own reader.

Everything read here may be written by an attacker: every rule is an allow
list, and every read and allocation is bounded by what the file justifies.
May import: `_bytes`, `_errors`, `_tree` (text checks).
"""
