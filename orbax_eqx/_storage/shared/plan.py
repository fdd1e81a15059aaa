"""What a dedup save writes and what it refers to: the identities of its
arrays, the base step, and the plan of its pack."""

import dataclasses
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from ..._bytes import route as _route
from ..._format import sidecar_read as _sidecar_read
from ..._format.checksum import identity as identity
from ..._format.checksum import xxh3_from_identity
from ..._format.compact import row_nbytes
from ..._format.sidecar import (
    FILE_NAME,
    FORMAT_VERSION,
    PACKED,
    SHARDS,
    Metadata,
    PackMetadata,
    leaf_metadata,
    pack_file,
    shared_dir,
)
from ..._tree.walk import ARRAY
from .. import ranges as _ranges
from .steps import final_name, step_dirs, step_number


class Known:
    """The identities of jax arrays a handler saved: an array is immutable,
    so the very same object has the same bytes, and its checksum need not be
    computed again while it lives. Numpy arrays, which change in place, are
    never kept."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self._by_id: dict[tuple, tuple[weakref.ref, str]] = {}
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
            elif (r := fields(r)) is not None:
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
            self._last[final_name(directory)] = (version, saved)

    def last_save(self, item: epath.Path) -> Metadata | None:
        """What `wrote` noted, if the sidecar in `item` is that very file."""
        with self._lock:
            found = self._last.get(final_name(item))
        if found is None or found[0] is None:
            return None
        path = epath.Path(item) / FILE_NAME
        if _route.for_path(path).version(path) != found[0]:
            return None
        return dataclasses.replace(found[1], directory=str(item))  # (committed)

    def get(self, x: Any, part: Any = None) -> str | None:
        """The XXH3-128 of the bytes of jax array `x` (of its chunk `part`,
        `(start, stop)`), if saved before."""
        with self._lock:
            found = self._by_id.get((id(x), part))
        if found is None or found[0]() is not x:
            return None
        return found[1]

    def put(self, x: Any, identity: str, part: Any = None) -> None:
        if not isinstance(x, jax.Array):
            return
        key = (id(x), part)

        def forget(_: Any, key: tuple = key) -> None:
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
        steps = step_dirs(root)
    except Exception:
        return None
    ordered = sorted(
        (s for s, items in steps.items() if item in items and s != step),
        key=step_number,
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

    records: dict[str, Any]
    packs: list[dict[str, Any]]
    file: str
    pieces: list[tuple[int, np.ndarray]]
    nbytes: int
    written: list[str]
    sums: list[int | None]  # their XXH3-64s, where read off their XXH3-128s


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
    leaves = content["leaves"]
    records, new, kept = _sorted_out(leaves, names, pieces, saved, originals, known)
    at, nbytes = _ranges.layout((name, host.nbytes) for name, host in new)
    file = pack_file(token, 0)
    packs = [_pack(file, nbytes)] if new else []
    for name, _ in new:
        records[name].update(pack=0, offset=at[name])
    _refer_to(saved, kept, records, packs)
    rows = {n for n in names if type(leaves[n]) is list}  # rows stay rows
    return Plan(
        {n: _as_row(r) if n in rows else r for n, r in records.items()},
        packs,
        file,
        [(at[name], host) for name, host in new],
        nbytes,
        [name for name, _ in new],
        [xxh3_from_identity(records[n]["xxh3_128"], h.nbytes) for n, h in new],
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


def _sorted_out(leaves, names, pieces, saved, originals, known) -> tuple:
    """`(records, new, kept)`: each packed leaf's whole record with its
    XXH3-128; `(name, host copy)` of those to write; `(name, the base's
    record)` of those the base holds."""
    records: dict[str, dict[str, Any]] = {}
    new: list[tuple[str, np.ndarray]] = []
    kept: list[tuple[str, Any]] = []
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
    return records, new, kept


def _refer_to(saved: Any, kept: list, records: dict, packs: list) -> None:
    """Makes the records of the `kept` leaves refer to the base's bytes, in
    packs listed in `packs` (appended as first needed)."""
    index: dict[str, int] = {}  # a referenced pack's file: its place in `packs`
    for name, old in kept:
        pack = saved.packs[old.pack]
        if pack.file not in index:
            index[pack.file] = len(packs)
            packs.append(_pack(pack.file, pack.nbytes))
        record = records[name]
        record.update(pack=index[pack.file], offset=old.offset)
        record["xxh3"] = None if old.checksum is None else f"{old.checksum:016x}"


def _as_row(r: dict[str, Any]) -> list:
    """A jax array's record as the row of a dedup save (`compact`)."""
    stored = [r["xxh3"], r["xxh3_128"], r["pack"]]
    return [r["dtype"], r["shape"], r["offset"], stored]


def fields(record: Any) -> dict[str, Any] | None:
    """A packed leaf's record of a dedup save as a whole record, whatever
    its form; None for any other record."""
    if type(record) is list and type(record[3]) is list:
        xxh3, ident, pack = record[3]
        row = [*record[:3], xxh3]
        return {**_whole(row), "xxh3_128": ident, "pack": pack}
    if isinstance(record, dict) and record.get("data") == PACKED:
        return record if "xxh3_128" in record else None
    return None


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
