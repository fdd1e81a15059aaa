"""Which committed steps beside the shared directory refer to which shared
files, and the clean-up that deletes the others."""

import os
import re
from typing import Any

import msgspec
import orbax.checkpoint as ocp
from etils import epath

from ..._bytes import route as _route
from ..._format import sealed as _sealed
from ..._format import sidecar_read as _sidecar_read
from ..._format.schema import PackRecord, ShardFile
from ..._format.sidecar import (
    FILE_NAME,
    MAX_BYTES,
    PACKED,
    SHARED_DIR,
    TOKEN,
    Metadata,
    shard_index,
)

_TMP_MARK = ocp.path.atomicity.TMP_DIR_SUFFIX
_COMMITTED = "commit_success.txt"  # how Orbax commits a step on an object store
_NUMBER = re.compile(r"(\d+)$")
# A shared pack or shard pack, or what a write killed midway left of one
# (`files.create_new`).
_OURS = re.compile(
    f"({_sidecar_read.PACK_NAME.pattern}|{_sidecar_read.SHARD_NAME.pattern})"
    r"(\.tmp-[0-9a-f]{16})?"
)


def final_name(directory: Any) -> str:
    """An item directory's name once Orbax commits it."""
    return epath.Path(directory).name.split(_TMP_MARK)[0]


def step_dirs(root: epath.Path) -> dict[str, list[str]]:
    """`{step directory name: [item names]}` of the committed steps under
    `root` that hold orbax_eqx items (and of none being saved)."""
    listed = _route.for_path(root).listing(root, 3)
    steps: dict[str, list[str]] = {}
    # (`<step>/<item>/commit_success.txt` is written before: no commit yet.)
    committed = {n.split("/")[0] for n in listed if n.partition("/")[2] == _COMMITTED}
    remote = _route.is_remote(root)
    for name in listed:
        parts = name.split("/")
        if len(parts) != 3 or parts[2] != FILE_NAME:
            continue
        step, item = parts[0], parts[1]
        if _TMP_MARK in step or step == SHARED_DIR:
            continue
        if remote and step not in committed:
            continue  # there Orbax commits a step by a file, not a rename
        steps.setdefault(step, []).append(item)
    return steps


def step_number(step: str) -> int:
    found = _NUMBER.search(step)
    return int(found[1]) if found else -1


class _Packs(msgspec.Struct):
    packs: list[PackRecord] = []
    token: str = ""
    shard_files: int = 0


class ShardFiles(msgspec.Struct):
    shared: bool = False
    files: list[ShardFile] = []


def _shared_packs(item: epath.Path) -> set[str] | None:
    """The shared packs and shard packs the sidecar in `item` and its shard
    indexes refer to; an empty set if it is gone (deleted meanwhile), None if
    it, or an index, cannot be read."""
    try:
        found = _sealed_json(item / FILE_NAME, _Packs)
    except FileNotFoundError:
        return set()
    except Exception:
        return None
    live = {p.file for p in found.packs if p.shared}
    if found.shard_files and not TOKEN.fullmatch(found.token):
        return None
    try:
        for process in range(found.shard_files):
            index = _sealed_json(item / shard_index(found.token, process), ShardFiles)
            live |= {f.file for f in index.files if index.shared}
    except Exception:  # (a missing index too: a step half deleted, or damaged)
        return None
    return live


def _sealed_json(path: epath.Path, kind: type) -> Any:
    raw = _route.read_bounded(path, MAX_BYTES)
    if not _sealed.check(raw, ValueError):
        raise ValueError(f"{path} records no checksum")
    return msgspec.json.decode(raw, type=kind)


def referenced(
    root: epath.Path, saving: epath.Path | None = None, strict: bool = False
) -> set[str] | None:
    """Every shared pack and shard pack that a committed step under `root`, or
    the step directory `saving`, refers to; None if a sidecar or a shard index
    could not be read (with `strict`, raises `Unreadable` naming the sidecar)."""
    steps = step_dirs(root)
    items = [root / step / item for step, names in steps.items() for item in names]
    if saving is not None:
        listed = _route.for_path(saving).listing(saving, 2)
        items += [
            saving / n.split("/")[0] for n in listed if n.endswith("/" + FILE_NAME)
        ]
    live: set[str] = set()
    for item in items:
        found = _shared_packs(item)
        if found is None:
            if strict:
                raise Unreadable(str(item))
            return None
        live |= found
    return live


class Unreadable(Exception):
    """An item whose sidecar or shard indexes a clean-up could not read: it
    deletes nothing."""


def saves_under_way(root: epath.Path) -> list[str]:
    """The step directories under `root` that a save is writing, or that a
    killed save left: Orbax's temporary ones, and on object stores those
    without their own commit file (see `step_dirs`)."""
    listed = _route.for_path(root).listing(root, 3)
    tops = {n.split("/")[0] for n in listed if "/" in n}
    if not _route.is_remote(root):
        try:
            tops |= {e.name for e in os.scandir(root) if e.is_dir()}
        except FileNotFoundError:
            pass
    found = sorted(t for t in tops if _TMP_MARK in t)
    if _route.is_remote(root):
        committed = {
            n.split("/")[0] for n in listed if n.partition("/")[2] == _COMMITTED
        }
        saving = {n.split("/")[0] for n in listed if n.endswith("/" + FILE_NAME)}
        found += sorted(saving - committed - {SHARED_DIR})
    return found


class Busy(Exception):
    """A save is under way beside the steps a clean-up by hand would touch."""


def collect(
    root: epath.Path, saving: epath.Path | None = None, strict: bool = False
) -> list[str]:
    """Deletes the shared packs and shard packs under `root` that no committed
    step (nor the step directory `saving`) refers to, and what killed writes
    left of them; returns their names. Deletes nothing if any step's sidecar
    or shard index cannot be read (with `strict`, raises `Unreadable` naming
    the sidecar). A save runs it while no other save of its manager writes
    (Orbax saves one at a time); run by hand (no `saving`), it raises `Busy`
    if a save is under way once the packs are listed (a save that starts
    later writes packs not listed)."""
    where = epath.Path(root) / SHARED_DIR
    store = _route.for_path(where)
    present = [n for n in store.listing(where, 1) if _OURS.fullmatch(n)]
    if not present:
        return []
    if saving is None and (busy := saves_under_way(epath.Path(root))):
        raise Busy(", ".join(busy[:4]))
    try:
        live = referenced(epath.Path(root), saving, strict=True)
    except Unreadable:
        if strict:
            raise
        return []
    if live is None:  # (not with `strict`)
        return []
    gone = []
    for name in present:
        if name not in live:
            store.delete(where / name)
            gone.append(name)
    return gone


def sharing(
    item: epath.Path, saved: Metadata, chunks: dict[str, int] | None = None
) -> dict[str, Any]:
    """For an item saved with `dedup`: the bytes of its arrays in files its
    own save wrote (`own`) and in earlier saves' (`shared`), and for each
    shared file it refers to, the other steps under the root that refer to
    it. `chunks`: the bytes of its sharded leaves in each shared shard pack."""
    item = epath.Path(item)
    used: dict[str, int] = dict(chunks or {})
    for leaf in saved.leaves.values():
        if leaf.data != PACKED or leaf.pack is None:
            continue
        pack = saved.packs[leaf.pack]
        if pack.shared:
            used[pack.file] = used.get(pack.file, 0) + leaf.nbytes
    mine = f".{saved.token}."  # in the names of the files this save wrote
    own = sum(n for f, n in used.items() if mine in f)
    shared = sum(used.values()) - own
    root, here = item.parent.parent, item.parent.name
    steps: dict[str, list[str]] = {name: [] for name in used}
    for step, names in sorted(step_dirs(root).items(), key=lambda s: step_number(s[0])):
        if step == here:
            continue
        refers = set().union(*(_shared_packs(root / step / n) or set() for n in names))
        for name in used:
            if name in refers:
                steps[name].append(step)
    return {"own": own, "shared": shared, "packs": used, "steps": steps}
