"""Typed groups: the jax arrays of one `serialize` call of `PackedArrayHandler`."""

import dataclasses
import hashlib
import json
import math
import secrets
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from ..._bytes import route as _route
from ..._format import sidecar as _sidecar
from ..._format import sidecar_write as _sidecar_write
from ..._format.sidecar import EMPTY, PACKED, SHARDS, itemsize, pack_file
from ..._tree.walk import JAX, is_key_dtype
from .. import ranges as _ranges
from ..packed import write as _packed
from ..sharded import write as _shards
from ..transfer import to_host as _to_host

GROUP_DIR = "orbax_eqx~typed.{group}"
GROUP_PREFIX = "orbax_eqx~typed."
SEAL_FILE = "orbax_eqx~typed-seal.{group}"
SEAL_PREFIX = "orbax_eqx~typed-seal."


def seal(sidecar: bytes) -> str:
    """The seal's content for a group whose sidecar holds `sidecar`."""
    return hashlib.sha256(sidecar).hexdigest() + "\n"


def group_of(names: Sequence[str]) -> str:
    """The group's name: 16 hex digits of a hash of its leaf names, in order."""
    digest = hashlib.sha256(json.dumps(list(names)).encode("utf-8"))
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class Taken:
    """What one process writes for a group; `write` empties the host copies."""

    group: str
    content: dict[str, Any]  # the group's sidecar, packed leaves' checksums to come
    pieces: list[tuple[int, np.ndarray]]  # (offset, host copy): the primary's pack
    packed: list[str]  # the leaf of each piece
    pack_nbytes: int
    local: _shards.Local | None  # this process's shards, if any leaf has some


def take(
    names: Sequence[str],
    paths: Sequence[str],
    values: Sequence[jax.Array],
    shardings: Sequence[Any],
    casts: Sequence[Any],
    *,
    primary_host: int,
) -> Taken:
    """Host copies of what this process writes for `values`, taken now."""
    primary = jax.process_index() == primary_host
    records: dict[str, dict[str, Any]] = {}
    to_pack, to_shard = [], []
    cast_of = {}  # leaf -> the dtype stored, where not the array's own
    for name, path, x, sharding, cast in zip(
        names, paths, values, shardings, casts, strict=True
    ):
        dtype = x.dtype
        if cast is not None and not is_key_dtype(dtype) and np.dtype(cast) != dtype:
            dtype = cast_of[name] = np.dtype(cast)  # keys have no other dtype
        size = math.prod(x.shape) * itemsize(dtype)
        record: dict[str, Any] = {
            "path": path,
            "kind": "array",
            "shape": list(x.shape),
            "dtype": str(dtype),
            "container": JAX,
            "nbytes": size,
        }
        if not size:
            record["data"] = EMPTY
        elif x.is_fully_replicated and _held_by(x, primary_host):
            record.update(data=PACKED, pack=0)
            to_pack.append((name, x, size))
        else:
            record["data"] = SHARDS
            to_shard.append((name, x))
        if sharding is not None:
            record["sharding"] = json.dumps(sharding, sort_keys=True)
        records[name] = record
    offsets, pack_nbytes = _ranges.layout((n, size) for n, _, size in to_pack)
    for name, offset in offsets.items():
        records[name]["offset"] = offset
    pieces, local = _host_copies(primary, to_pack, to_shard, offsets, cast_of)
    group = group_of(names)
    content = {
        "format": _sidecar.FORMAT,
        "format_version": _sidecar.FORMAT_VERSION,
        "versions": _sidecar.package_versions(),
        "token": group,
        "save": secrets.token_hex(8),
        "packs": [
            {
                "file": pack_file(group, 0),
                "nbytes": pack_nbytes,
                "byteorder": sys.byteorder,
                "alignment": _sidecar.PACK_ALIGNMENT,
            }
        ]
        if to_pack
        else [],
        "shard_files": jax.process_count() if to_shard else 0,
        "leaves": records,
        "modules": {},
        "nodes": {},
    }
    return Taken(group, content, pieces, [n for n, _, _ in to_pack], pack_nbytes, local)


def _host_copies(primary: bool, to_pack, to_shard, offsets, cast_of):
    """`(pieces, local)`: the packed arrays' host copies at their offsets (the
    primary host's to write), and this process's shards, each cast where
    `cast_of` says."""
    pieces: list[tuple[int, np.ndarray]] = []
    if primary and to_pack:
        hosts = _to_host.host_copies([x for _, x, _ in to_pack])
        pieces = [
            (offsets[name], _cast(host, cast_of.get(name)))
            for (name, _, _), host in zip(to_pack, hosts, strict=True)
        ]
    local = None
    if to_shard:
        local = _shards.take(to_shard)
        local.hosts = [
            _cast(host, cast_of.get(name))
            for name, host in zip(local.names, local.hosts, strict=True)
        ]
    return pieces, local


def _held_by(x: jax.Array, process: int) -> bool:
    """Whether `process` holds a copy of `x` (every process can tell)."""
    devices: set[Any] = x.sharding.device_set  # (jax's Device: partly typed)
    return any(d.process_index == process for d in devices)


def _cast(host: np.ndarray, cast: Any) -> np.ndarray:
    if cast is None:
        return host
    return host.astype(cast)  # a copy: the view of a device buffer goes


def write(directory: epath.Path, taken: Taken, process: int, primary: bool) -> None:
    """Writes this process's files of the group into item directory `directory`."""
    where = epath.Path(directory) / GROUP_DIR.format(group=taken.group)
    if taken.local is None and not primary:
        return
    where.mkdir(parents=True, exist_ok=True)  # as TensorStore does for Orbax
    if taken.local is not None:
        _shards.write(where, taken.group, process, taken.local)
    if not primary:
        return
    content = taken.content
    sums = []
    if taken.pieces:
        path = where / pack_file(taken.group, 0)
        sums = _packed.write(path, taken.pieces, taken.pack_nbytes)
        # Let go of device buffers' views (see `transfer.to_host.host_copies`).
        taken.pieces = []
    _sidecar.record_checksums(content, dict(zip(taken.packed, sums, strict=True)), {})
    data = _sidecar_write.to_bytes(content)
    _route.write_whole(where / _sidecar.FILE_NAME, data)
    # Beside the group's directory, not in it: binds the directory's sidecar
    # (and through its checksums and save, its packs) to this checkpoint.
    _route.write_whole(
        epath.Path(directory) / SEAL_FILE.format(group=taken.group),
        seal(data).encode("ascii"),
    )
