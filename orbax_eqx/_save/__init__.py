"""Saving: an item split into what each storage gets, and a save's safety.

Owns preparing a save (`prepare`: sidecar content, packed pieces, arrays for
Orbax), refusing what the sidecar could not read back (`recordable`) and
arrays that would not restore as they are (`storable`), the
multi-host checks before any write (`hosts`), claiming the item directory
against a concurrent save of the same step (`claim`), writing the save's own
files in its background thread (`files`: shard packs, the pack while the
leaves are named (`pack_write`), the sidecar last), naming the save in
errors from background writes (`background`), finishing the saves still
under way when a script ends (`at_exit`), keeping a failed save's threads
from holding the process (`released`), and a standalone save's atomic replace
(`replace`) with the directories it writes beside its target (`leftovers`).
May import: `_storage`, `_format`, `_tree`, `_bytes`, `_errors`, and `_gc`
(the collector paused while the background thread names the leaves); never
`_restore` (a save checks nothing a restore owns).
"""
