"""The mapping between leaf names and another layout's names: `StateDictMapping`
(`mapping`), its rules (`rules/`, one a file), the names they are written in
(`templates`, `regex`: RE2), the planner (`plan`, `stage`, `pieces`), renames
on names alone (`names`) and the wording of problems (`wording`).
May import: `_tree`, `_bytes`, `_errors`."""
