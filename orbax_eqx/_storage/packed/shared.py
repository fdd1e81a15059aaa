"""Packs shared between the steps of a manager (`EqxHandler(dedup=True)`).

A save with `dedup` writes its pack into `<root>/orbax_eqx~shared/`, beside
the step directories, and records each packed leaf's XXH3-128. The next save
reads the sidecar of the newest committed step of its item (the *base*): a
leaf of the same name, dtype, shape and XXH3-128 is recorded as a reference to
the base's bytes, wherever they lie, instead of being written again. So every
reference points at a shared pack directly, never through another step, and
deleting any step (Orbax's retention, `rm -r`) breaks no other.

A shared pack is deleted only by `collect`, which a save runs once its own
files are written: it keeps every pack that a committed step or the step being
saved refers to, and deletes the others (those of steps deleted since, and
of saves killed before their commit). Whatever it cannot read, it keeps.
Pack names are checked against the format's pattern; nothing else in the
directory is touched.
"""

import dataclasses
import json
import os
import re
import shutil
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import msgspec
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ..._bytes import route as _route
from ..._errors import SidecarError
from ..._format import sealed as _sealed
from ..._format import sidecar_read as _sidecar_read
from ..._format.checksum import identity as identity
from ..._format.compact import row_nbytes
from ..._format.schema import PackRecord, ShardFile
from ..._format.sidecar import (
    FILE_NAME,
    FORMAT_VERSION,
    MAX_BYTES,
    PACKED,
    SHARDS,
    SHARED_DIR,
    TOKEN,
    Metadata,
    PackMetadata,
    leaf_metadata,
    pack_file,
    pack_path,
    shard_index,
    shared_dir,
)
from ..._tree.walk import ARRAY
from .. import ranges as _ranges

_TMP_MARK = ocp.path.atomicity.TMP_DIR_SUFFIX
_COMMITTED = "commit_success.txt"  # how Orbax commits a step on an object store
_NUMBER = re.compile(r"(\d+)$")
# A shared pack or shard pack, or what a write killed midway left of one
# (`files.create_new`).
_OURS = re.compile(
    f"({_sidecar_read.PACK_NAME.pattern}|{_sidecar_read.SHARD_NAME.pattern})"
    r"(\.tmp-[0-9a-f]{16})?"
)


class Known:
    """The identities of jax arrays a handler saved: an array is immutable,
    so the very same object has the same bytes, and its checksum need not be
    computed again while it lives. Numpy arrays, which change in place, are
    never kept."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, str]] = {}
        self._lock = threading.Lock()
        # Per item name: the version of the sidecar last written, and what
        # a base needs of it (see `base`).
        self._last: dict[str, tuple[Any, Metadata]] = {}

    def wrote(self, directory: epath.Path, content: dict[str, Any]) -> None:
        """Notes the sidecar just written in the item `directory`: its packed
        leaves' records, and its sharded leaves' dtypes and shapes, as the
        next save's base reads them."""
        packs = tuple(
            PackMetadata(p["file"], p["nbytes"], p.get("shared", False))
            for p in content["packs"]
        )
        leaves = {}
        for name, r in content["leaves"].items():
            if isinstance(r, dict) and r.get("data") == SHARDS:
                shape, dtype = tuple(r["shape"]), r["dtype"]
                leaves[name] = leaf_metadata(name, "", ARRAY, shape, dtype, data=SHARDS)
            elif isinstance(r, dict) and r.get("data") == PACKED and "xxh3_128" in r:
                xxh3 = r.get("xxh3")
                leaves[name] = leaf_metadata(
                    name,
                    "",
                    ARRAY,
                    tuple(r["shape"]),
                    r["dtype"],
                    r["container"],
                    PACKED,
                    nbytes=r["nbytes"],
                    pack=r["pack"],
                    offset=r["offset"],
                    checksum=None if xxh3 is None else int(xxh3, 16),
                    identity=r["xxh3_128"],
                )
        path = epath.Path(directory) / FILE_NAME
        version = _route.for_path(path).version(path)
        saved = Metadata(
            str(directory),
            FORMAT_VERSION,
            {},
            leaves,
            {},
            packs,
            content["token"],
            content["shard_files"],
        )
        with self._lock:
            self._last[_final_name(directory)] = (version, saved)

    def last_save(self, item: epath.Path) -> Metadata | None:
        """What `wrote` noted, if the sidecar in `item` is that very file."""
        with self._lock:
            found = self._last.get(_final_name(item))
        if found is None or found[0] is None:
            return None
        path = epath.Path(item) / FILE_NAME
        if _route.for_path(path).version(path) != found[0]:
            return None
        return dataclasses.replace(found[1], directory=str(item))  # (committed)

    def get(self, x: Any) -> str | None:
        """The XXH3-128 of the bytes of jax array `x`, if saved before."""
        with self._lock:
            found = self._by_id.get(id(x))
        if found is None or found[0]() is not x:
            return None
        return found[1]

    def put(self, x: Any, identity: str) -> None:
        if not isinstance(x, jax.Array):
            return
        key = id(x)

        def forget(_: Any, key: int = key) -> None:
            with self._lock:
                held = self._by_id.get(key)
                if held is not None and held[0]() is None:
                    del self._by_id[key]

        try:
            ref = weakref.ref(x, forget)
        except TypeError:
            return
        with self._lock:
            if len(self._by_id) < self.MAX:
                self._by_id[key] = (ref, identity)


def _final_name(directory: Any) -> str:
    """An item directory's name once Orbax commits it."""
    return epath.Path(directory).name.split(_TMP_MARK)[0]


def _step_dirs(root: epath.Path) -> dict[str, list[str]]:
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


def _number(step: str) -> int:
    found = _NUMBER.search(step)
    return int(found[1]) if found else -1


def base(
    directory: epath.Path, step: str, item: str, known: "Known | None" = None
) -> Metadata | None:
    """The sidecar of the newest committed step other than `step` whose item
    `item` has shared packs or shard packs, for the save into `directory`;
    None if there is none, or it cannot be read (the save then writes every
    leaf). Where that is the sidecar `known` saw written last, unchanged, it
    is not read again."""
    root = epath.Path(directory).parent.parent
    try:
        steps = _step_dirs(root)
    except Exception:
        return None
    ordered = sorted(
        (s for s, items in steps.items() if item in items and s != step),
        key=_number,
        reverse=True,
    )
    for name in ordered[:1]:
        path = root / name / item
        if known is not None and (saved := known.last_save(path)) is not None:
            return saved
        try:
            saved = _sidecar_read.read(path, nodes=False)
        except Exception:
            return None
        if saved.shard_files or any(p.shared for p in saved.packs):
            return saved
    return None


@dataclasses.dataclass
class Plan:
    """Where each packed leaf of a dedup save goes: `records` replace their
    sidecar records and `packs` its list of packs; `pieces` (offset, bytes)
    make the new shared pack `file` of `nbytes` (none if empty), whose leaves
    are `written`, in the pieces' order."""

    records: dict[str, dict[str, Any]]
    packs: list[dict[str, Any]]
    file: str
    pieces: list[tuple[int, np.ndarray]]
    nbytes: int
    written: list[str]


def _pack(file: str, nbytes: int) -> dict[str, Any]:
    return {
        "file": file,
        "nbytes": nbytes,
        "byteorder": sys.byteorder,
        "alignment": 64,
        "shared": True,
    }


def plan(
    token: str,
    content: dict[str, Any],
    names: Sequence[str],
    pieces: Sequence[tuple[int, np.ndarray]],
    saved: Metadata | None,
    originals: Sequence[Any] = (),
    known: Known | None = None,
) -> Plan:
    """The references and the new pack of a dedup save of `content` (its
    packed leaves `names`, with their host copies `pieces`, of the arrays
    `originals`), against the base step `saved`: a leaf the base holds, byte
    for byte, is a reference. `known`: identities of arrays saved before."""
    records: dict[str, dict[str, Any]] = {}
    new: list[tuple[str, np.ndarray]] = []
    kept: list[tuple[str, Any]] = []  # (name, the base's record)
    leaves = content["leaves"]
    originals = originals or [None] * len(names)
    for name, (_, host), x in zip(names, pieces, originals, strict=True):
        record = records[name] = _whole(leaves[name])
        seen = known.get(x) if known is not None and x is not None else None
        record["xxh3_128"] = seen if seen is not None else identity(host)
        old = _same(saved, name, record)
        if old is None:
            new.append((name, host))
        else:
            kept.append((name, old))
    at, nbytes = _ranges.layout((name, host.nbytes) for name, host in new)
    file = pack_file(token, 0)
    packs = [_pack(file, nbytes)] if new else []
    for name, _ in new:
        records[name].update(pack=0, offset=at[name])
    index: dict[str, int] = {}  # a referenced pack's file: its place in `packs`
    for name, old in kept:
        pack = saved.packs[old.pack]  # type: ignore[union-attr]
        if pack.file not in index:
            index[pack.file] = len(packs)
            packs.append(_pack(pack.file, pack.nbytes))
        record = records[name]
        record.update(pack=index[pack.file], offset=old.offset)
        record["xxh3"] = None if old.checksum is None else f"{old.checksum:016x}"
    return Plan(
        records,
        packs,
        file,
        [(at[name], host) for name, host in new],
        nbytes,
        [name for name, _ in new],
    )


def _whole(record: Any) -> dict[str, Any]:
    """A packed leaf's record as a whole record (a row is a jax array's)."""
    if isinstance(record, dict):
        return dict(record)
    dtype, shape, offset, xxh3 = record
    return {
        "kind": "array",
        "shape": shape,
        "dtype": dtype,
        "container": "jax",
        "nbytes": row_nbytes(shape, dtype),
        "data": PACKED,
        "pack": 0,
        "offset": offset,
        "xxh3": xxh3,
    }


def _same(saved: Metadata | None, name: str, record: dict) -> Any:
    """The base's record of leaf `name` if it holds the same bytes in a shared
    pack: the same dtype, shape and XXH3-128."""
    if saved is None:
        return None
    old = saved.leaves.get(name)
    if (
        old is None
        or old.data != PACKED
        or old.identity != record["xxh3_128"]
        or old.dtype != record["dtype"]
        or list(old.shape or ()) != list(record["shape"])
        or old.pack is None
        or not saved.packs[old.pack].shared
    ):
        return None
    return old


def apply(content: dict[str, Any], planned: Plan) -> None:
    """Puts the planned records and packs into the sidecar's `content`."""
    content["leaves"].update(planned.records)
    content["packs"] = planned.packs


def ensure_dir(directory: epath.Path) -> epath.Path:
    """The shared directory beside the item `directory`, made if need be."""
    where = shared_dir(directory)
    if not _route.is_remote(where):
        where.mkdir(parents=True, exist_ok=True)
    return where


class _Packs(msgspec.Struct):
    packs: list[PackRecord] = []
    token: str = ""
    shard_files: int = 0


class _ShardFiles(msgspec.Struct):
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
            index = _sealed_json(item / shard_index(found.token, process), _ShardFiles)
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
    steps = _step_dirs(root)
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
    killed save left: Orbax's temporary ones, and on gs:// those without
    their commit file."""
    listed = _route.for_path(root).listing(root, 3)
    tops = {n.split("/")[0] for n in listed if "/" in n}
    if not _route.is_remote(root):
        try:
            tops |= {e.name for e in os.scandir(root) if e.is_dir()}
        except FileNotFoundError:
            pass
    found = sorted(t for t in tops if _TMP_MARK in t)
    if root.as_posix().startswith("gs://"):
        committed = {n.split("/")[0] for n in listed if n.endswith("/" + _COMMITTED)}
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
    for step, names in sorted(_step_dirs(root).items(), key=lambda s: _number(s[0])):
        if step == here:
            continue
        refers = set().union(*(_shared_packs(root / step / n) or set() for n in names))
        for name in used:
            if name in refers:
                steps[name].append(step)
    return {"own": own, "shared": shared, "packs": used, "steps": steps}


def copy_step(step: epath.Path, destination: epath.Path) -> list[str]:
    """Copies a step of a manager saved with `EqxHandler(dedup=True)` into a
    directory of its own that holds every byte it needs, for sharing it or
    keeping it after the shared bytes are gone.

    **Arguments:**

    - `step`: the step directory (`<root>/<step>`), or one item of it.
    - `destination`: a new directory. Name it as the step (`.../1000`) to
        restore it without the warning of a moved step (`on_moved=`).

    **Returns:** the names of the shared packs copied into it.

    The copy is written beside `destination` under another name and renamed
    into place: an interrupted copy leaves no `destination`. Steps saved
    without `dedup` are copied as they are. Local directories only.

    !!! example

        ```python
        oeqx.copy_step("ckpts/1000", "release/1000")
        model = oeqx.restore("release/1000/default", skeleton)
        ```
    """
    step, destination = epath.Path(step), epath.Path(destination)
    for path, what in ((step, "step"), (destination, "destination")):
        if _route.is_remote(path):
            raise ValueError(
                f"Copying a step works on local directories; the {what} {path} is "
                "in an object store. Copy the step to a local disk first "
                "(`gcloud storage cp -r`, `aws s3 cp --recursive`), with the "
                f"`{SHARED_DIR}` directory beside it."
            )
    if not step.is_dir():
        raise FileNotFoundError(f"{step} is not a directory: pass a step directory.")
    if destination.exists():
        raise FileExistsError(
            f"{destination} exists already; pass the path of a new directory."
        )
    items = [p.parent for p in step.glob(f"*/{FILE_NAME}")]
    if (step / FILE_NAME).exists():
        items.append(step)  # an item directory given as the step
    temporary = destination.parent / f".{destination.name}.orbax_eqx-copy-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    copied: list[str] = []
    try:
        shutil.copytree(step, temporary, symlinks=True)
        for item in items:
            where = temporary / item.relative_to(step)
            copied += _hold_own_bytes(item, where)
        os.rename(temporary, destination)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return copied


def _hold_own_bytes(item: epath.Path, copy: epath.Path) -> list[str]:
    """Copies the shared packs and shard packs of the item `item` into its
    copy `copy`, and rewrites the copy's sidecar and shard indexes to find
    them there."""
    path = copy / FILE_NAME
    raw = path.read_bytes()

    def damaged(what: str) -> Exception:
        return SidecarError(
            f"The sidecar {item / FILE_NAME} {what}: the step is damaged and "
            "was not copied. Copy another step."
        )

    if not _sealed.check(raw, damaged):
        raise damaged("records no checksum")
    saved = _sidecar_read.read(item, nodes=False)  # every record checked
    copied = _hold_own_shards(item, copy, saved)
    shared = [p for p in saved.packs if p.shared]
    if not shared:
        return copied
    for pack in shared:
        _copy_in(item, pack_path(item, pack), copy, pack.nbytes, "pack")
    lines = raw.split(b"\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(b' "packs": '))
    packs = json.loads(lines[at][len(b' "packs": ') :].rstrip(b","))
    for record in packs:
        record.pop("shared", None)
    lines[at] = b' "packs": ' + json.dumps(packs).encode() + b","
    body = b"\n".join(lines[:-3]) + b"\n"  # up to the checksum line
    path.write_bytes(_sealed.seal(body))
    return [p.file for p in shared] + copied


def _copy_in(item, source: epath.Path, copy: epath.Path, nbytes: int, what: str):
    if not source.exists() or os.path.getsize(source) != nbytes:
        raise SidecarError(
            f"The shared {what} {source}, which the step {item} refers to, is "
            f"{'missing' if not source.exists() else 'not of its recorded size'}"
            ": the step cannot be copied whole. Copy another step."
        )
    shutil.copyfile(source, copy / source.name)


_SHARED_FILES = b', "shared": true, "files": '


def _hold_own_shards(item: epath.Path, copy: epath.Path, saved: Metadata) -> list:
    """Copies the shared shard packs the item's shard indexes list into the
    copy, and rewrites the copy's indexes (re-sealed) to find them there."""
    copied: list[str] = []
    for process in range(saved.shard_files):
        path = copy / shard_index(saved.token, process)
        raw = path.read_bytes()

        def damaged(what: str, path=path) -> Exception:
            return SidecarError(
                f"The shard index {item / path.name} {what}: the step is damaged "
                "and was not copied. Copy another step."
            )

        if not _sealed.check(raw, damaged):
            raise damaged("records no checksum")
        head, rest = raw.split(b"\n", 1)
        index = msgspec.json.decode(raw, type=_ShardFiles)
        if not index.shared:
            continue
        for record in index.files:
            if not _sidecar_read.SHARD_NAME.fullmatch(record.file):
                raise damaged(f"lists {record.file[:80]!r}, not a shard pack")
            source = shared_dir(item) / record.file
            _copy_in(item, source, copy, record.nbytes, "shard pack")
            copied.append(record.file)
        if head.count(_SHARED_FILES) != 1:
            raise damaged("is not a shard index as orbax_eqx writes it")
        body = head.replace(_SHARED_FILES, b', "files": ') + b"\n" + rest
        body = b"\n".join(body.split(b"\n")[:-3]) + b"\n"  # up to the checksum
        path.write_bytes(_sealed.seal(body))
    return copied
