"""Typed groups: the jax arrays of one `serialize` call of `PackedArrayHandler`.

Orbax's own handlers (`PyTreeCheckpointHandler`, `StandardCheckpointHandler`)
hand a `TypeHandler` every leaf of its type in one call; that call's arrays are
one group, stored in a directory of the item directory named by a hash of
their leaf names (the same on every process, with no communication):

```
<item>/orbax_eqx~typed-seal.9f2c41d07a3be865  # SHA-256 of the index (primary)
<item>/orbax_eqx~typed.9f2c41d07a3be865/
    orbax_eqx~typed.json                     # the group's index (primary host)
    orbax_eqx~packed.9f2c41d07a3be865.0.bin  # fully replicated arrays (primary)
    orbax_eqx~shards.9f2c41d07a3be865.<p>.bin, .json  # every process's shards
```

Fully replicated arrays (one device, or a copy on every device) are packed
(`packed`) by the primary host; the others go to shard packs (`sharded`),
every process writing the distinct shards it holds; zero-size arrays are
recorded only. The index, written last, records every leaf:

```
{"format": "orbax_eqx.typed", "format_version": 3, "group": "9f2c41d07a3be865",
 "save": "5be1c0a2d4e6f809",
 "processes": 2, "versions": {...},
 "pack": {"file": "orbax_eqx~packed.9f2c41d07a3be865.0.bin", "nbytes": 4160,
          "byteorder": "little"},
 "shardings": [{...}, {...}],
 "leaves": {
  "params.w": {"path": "['params']['w']", "shape": [64, 16], "dtype": "float32",
      "nbytes": 4096, "data": "shards", "sharding": 0},
  "params.b": {..., "data": "packed", "offset": 4096, "xxh3": "9d3a61c2e8f0b457"},
  "empty": {..., "data": "none"}}}
```

A leaf's `sharding` is its saved sharding's place in `shardings` (or null),
each distinct one stored once; what they hold is the handler's (Orbax's
sharding metadata), opaque here. No computation runs on a device; processes
meet only at Orbax's own barrier. Reading is `typed.read`.
"""

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
from ..._format.checksum import XXH3
from ..._format.sidecar import (
    EMPTY,
    PACKED,
    SHARDS,
    itemsize,
    pack_file,
    package_versions,
)
from ..._tree.walk import is_key_dtype
from .. import ranges as _ranges
from ..packed import write as _packed
from ..sharded import write as _shards
from ..transfer import to_host as _to_host

GROUP_DIR = "orbax_eqx~typed.{group}"
GROUP_PREFIX = "orbax_eqx~typed."
INDEX_FILE = "orbax_eqx~typed.json"
INDEX_FORMAT = "orbax_eqx.typed"
# 2: the index names its save (`"save"`: 16 random hex digits), and a seal
# beside the group's directory, in the item directory, holds the SHA-256 of
# the index: a group directory copied in from another checkpoint (named
# alike: the same leaf names) carries another index, which the seal refuses.
# 3: packed leaves' data checksums are XXH3-64 (`"xxh3"`, 16 lower-case
# hexadecimal digits; they were CRC-32s, `"crc32"`), and the shard packs'
# indexes of version 3 (XXH3-64 blocks: `sharded.index`).
INDEX_VERSION = 3
SEAL_FILE = "orbax_eqx~typed-seal.{group}"
SEAL_PREFIX = "orbax_eqx~typed-seal."


def seal(index: bytes) -> str:
    """The seal's content for a group whose index file holds `index`."""
    return hashlib.sha256(index).hexdigest() + "\n"


def group_of(names: Sequence[str]) -> str:
    """The group's name: 16 hex digits of a hash of its leaf names, in order."""
    digest = hashlib.sha256(json.dumps(list(names)).encode("utf-8"))
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class Taken:
    """What one process writes for a group; `write` empties the host copies."""

    group: str
    index: dict[str, Any]  # the index's JSON, CRC-32s of packed leaves to come
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
    """Host copies of what this process writes for `values`, taken now.

    The caller may donate or change the arrays once this returns. `shardings`
    are stored as given (JSON); `casts` are dtypes to store instead of the
    array's own (or None), applied to the host copies. Every process decides
    the same for every leaf, from the arrays' global shardings alone.
    """
    primary = jax.process_index() == primary_host
    records: dict[str, dict[str, Any]] = {}
    table: dict[str, int] = {}  # each distinct sharding's JSON -> its place
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
            "shape": list(x.shape),
            "dtype": str(dtype),
        }
        record["nbytes"] = size
        if not size:
            record["data"] = EMPTY
        elif x.is_fully_replicated and _held_by(x, primary_host):
            record["data"] = PACKED
            to_pack.append((name, x, size))
        else:
            record["data"] = SHARDS
            to_shard.append((name, x))
        if sharding is not None:
            sharding = table.setdefault(
                json.dumps(sharding, sort_keys=True), len(table)
            )
        record["sharding"] = sharding
        records[name] = record
    offsets, pack_nbytes = _ranges.layout((n, size) for n, _, size in to_pack)
    for name, offset in offsets.items():
        records[name]["offset"] = offset
    pieces, local = _host_copies(primary, to_pack, to_shard, offsets, cast_of)
    group = group_of(names)
    index = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "group": group,
        "save": secrets.token_hex(8),
        "processes": jax.process_count() if to_shard else 0,
        "versions": package_versions(),
        "pack": {
            "file": pack_file(group, 0),
            "nbytes": pack_nbytes,
            "byteorder": sys.byteorder,
        }
        if to_pack
        else None,
        "shardings": [json.loads(text) for text in table],
        "leaves": records,
    }
    return Taken(group, index, pieces, [n for n, _, _ in to_pack], pack_nbytes, local)


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
    """Writes this process's files of the group into item directory `directory`.

    Every process writes its shard pack (if any leaf has shards); the primary
    writes the pack and, last, the index, so that the index names only bytes
    that are on disk (the other processes' files are there before Orbax's
    commit, which waits for every process).
    """
    where = epath.Path(directory) / GROUP_DIR.format(group=taken.group)
    if taken.local is None and not primary:
        return
    where.mkdir(parents=True, exist_ok=True)  # as TensorStore does for Orbax
    if taken.local is not None:
        _shards.write(where, taken.group, process, taken.local)
    if not primary:
        return
    index = taken.index
    if taken.pieces:
        path = where / pack_file(taken.group, 0)
        sums = _packed.write(path, taken.pieces, taken.pack_nbytes, algorithm=XXH3)
        # Let go of device buffers' views (see `transfer.to_host.host_copies`).
        taken.pieces = []
        for name, value in zip(taken.packed, sums, strict=True):
            index["leaves"][name][XXH3] = f"{value:016x}"
    text = _dump(index).encode("utf-8")
    _route.write_whole(where / INDEX_FILE, text)
    # Beside the group's directory, not in it: binds the directory's index
    # (and through its checksums and save token, its packs) to this checkpoint.
    _route.write_whole(
        epath.Path(directory) / SEAL_FILE.format(group=taken.group),
        seal(text).encode("ascii"),
    )


def _dump(index: dict[str, Any]) -> str:
    """The index as JSON, one line per leaf: readable, and diffs well."""
    head = json.dumps({k: v for k, v in index.items() if k != "leaves"})
    rows = ",\n".join(
        f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v, allow_nan=False)}"
        for k, v in index["leaves"].items()
    )
    return head[:-1] + ', "leaves": {\n' + rows + "\n}}\n"
