"""Saving: an item split into what each storage gets, and a save's safety.

Owns preparing a save (`prepare`: sidecar content, packed pieces, arrays for
Orbax), refusing what would not restore (`checks`),
claiming the item directory against a concurrent save of the same step
(`claim`), writing the save's own files in its background thread (`files`),
the futures handed to Orbax (`futures`), finishing saves still
under way when a script ends (`at_exit`), and a standalone save's atomic
replace (`replace`).
May import: `_storage`, `_format`, `_tree`, `_bytes`, `_errors`; never
`_restore` (a save checks nothing a restore owns).
"""
