"""The mapping between leaf names and another layout's names: data and planning.

Owns `StateDictMapping` (`mapping`: a list of rules, its JSON decoded by one
msgspec tagged union), the rules (`rules/`, one transformation a file with
its inverse beside it), the names rules are written in (`templates`) and the
regular expressions users give them (`regex`, matched by RE2 in linear
time), the planner (`plan`: both sides' shapes in, `pieces.Piece`s out, with
`stage` carrying the tensors in the making), names-only renames on their
fast path (`names`), and how problems are worded (`wording`), whether what
is stored is a checkpoint or a set of safetensors.
Pure data and computation, no I/O except reading a mapping file
(`StateDictMapping.from_file`, through `_bytes`).
May import: `_tree`, `_bytes`, `_errors`. Used by `_restore` (renames and
splits in a restore), `_bridge` (loads and exports) and the command line.
"""
