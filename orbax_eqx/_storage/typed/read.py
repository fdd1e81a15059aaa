"""Typed groups, read: a group's index checked, and its leaves read back.

Reading the index (see `typed`) validates every record before any array
byte is read: shapes, dtypes, where each leaf's bytes are. File names are
derived from the group's name, never read from the index. Leaves then go to
the pack reader (`packed.read`) or the shard-pack reader (`sharded.read`), which
read just the byte ranges wanted and check their CRC-32s.
"""

import dataclasses
import json
import math
import os
import re
from typing import Any, TypeGuard

import jax
import numpy as np
from etils import epath

from ..._bytes import route as _route
from ..._errors import CheckpointDamagedError, permission_denied
from ..._format.checksum import CRC32, XXH3
from ..._format.sidecar import (
    EMPTY,
    MAX_DIMS,
    PACKED,
    SHARDS,
    LeafMetadata,
    Metadata,
    PackMetadata,
    itemsize,
    leaf_metadata,
    pack_file,
)
from ..._tree.walk import (
    ARRAY,
    JAX,
    is_key_dtype,
    key_data_struct,
    key_impl,
    parse_dtype,
)
from ..packed import read as _packed
from ..sharded import read as _shard_read
from .write import (
    GROUP_DIR,
    GROUP_PREFIX,
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_VERSION,
    SEAL_FILE,
    SEAL_PREFIX,
    group_of,
    seal,
)

_MAX_INDEX_BYTES = 256 << 20  # a few hundred bytes per leaf: millions of leaves


@dataclasses.dataclass(frozen=True)
class Group:
    """One group as read back: its directory, and `Metadata` for the readers."""

    directory: epath.Path
    saved: Metadata  # leaves as `LeafMetadata`, the pack, the shard packs
    shardings: dict[str, Any]  # leaf name -> the stored sharding JSON


def find(directory: epath.Path) -> dict[str, Group]:
    """Every leaf of every group in item directory `directory`: `{name: Group}`.

    Empty if there are no groups (a checkpoint of Orbax's own handlers).
    Raises `CheckpointDamagedError` for a damaged index, naming file and leaf.
    """
    directory = epath.Path(directory)
    try:
        names = [p.name for p in directory.iterdir()]
        entries = sorted(n for n in names if n.startswith(GROUP_PREFIX))
        seals = sorted(n for n in names if n.startswith(SEAL_PREFIX))
    except PermissionError:
        raise permission_denied(directory) from None
    found: dict[str, Group] = {}
    groups = {entry[len(GROUP_PREFIX) :] for entry in entries}
    for entry in seals:
        group = entry[len(SEAL_PREFIX) :]
        if group not in groups:
            raise CheckpointDamagedError(
                f"The arrays saved with orbax_eqx's type handler in {directory} "
                f"are incomplete: the directory {GROUP_DIR.format(group=group)} "
                f"that {entry} seals is missing (deleted, or never copied). "
                "Restore an earlier step, or re-save this one."
            )
    for entry in entries:
        group = _read_group(directory / entry)
        for name in group.saved.leaves:
            if name in found:
                raise _damaged(
                    group.directory / INDEX_FILE,
                    f"leaf `{name}` is also in {found[name].directory.name}",
                )
            found[name] = group
    return found


def _read_group(where: epath.Path) -> Group:
    path = where / INDEX_FILE
    group = where.name[len(GROUP_PREFIX) :]
    text = _read_bounded(path)
    try:
        content = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _damaged(path, f"it is not valid JSON ({e})") from None

    def bad(what: str) -> CheckpointDamagedError:
        return _damaged(path, what)

    if not isinstance(content, dict) or content.get("format") != INDEX_FORMAT:
        raise bad(f'expected a JSON object with "format": "{INDEX_FORMAT}"')
    version = content.get("format_version")
    if type(version) is not int or not 1 <= version <= INDEX_VERSION:
        raise bad(
            f"format_version {version!r} is not 1 to "
            f"{INDEX_VERSION} (saved by a newer orbax_eqx?)"
        )
    if content.get("group") != group:
        raise bad(f"it names the group {content.get('group')!r}, not {group!r}")
    processes = content.get("processes")
    if not (_is_size(processes)):
        raise bad('"processes" must be a count')
    pack = content.get("pack")
    packs: tuple[PackMetadata, ...] = ()
    if pack is not None:
        if not (isinstance(pack, dict) and _is_size(pack.get("nbytes"))):
            raise bad('"pack" must be null or an object with "nbytes"')
        packs = (PackMetadata(pack_file(group, 0), pack["nbytes"]),)
    table, rows = content.get("shardings"), content.get("leaves")
    if not isinstance(table, list) or not isinstance(rows, dict):
        raise bad('"shardings" must be a JSON list and "leaves" an object')
    if group_of(list(rows)) != group:
        raise bad("its leaves are not those its group was named for")
    leaves, shardings = {}, {}
    for name, row in rows.items():
        leaves[name] = _parse_leaf(name, row, packs, version, bad)
        at = row.get("sharding")
        if at is not None and not (_is_size(at) and at < len(table)):
            raise bad(f"leaf `{name}` has the sharding {at!r}")
        shardings[name] = None if at is None else table[at]
    if any(r.data == SHARDS for r in leaves.values()) and not processes:
        raise bad("it has leaves in shard packs but no process wrote any")
    if version >= 2:
        _check_seal(where, group, text)
    saved = Metadata(
        directory=os.fspath(where),
        format_version=INDEX_VERSION,
        versions=content.get("versions") or {},
        leaves=leaves,
        modules={},
        packs=packs,
        token=group,
        shard_files=processes,
        # Version 3 wrote shard indexes of version 3 (XXH3-64 blocks), the
        # earlier ones of version 1 or 2.
        index_versions=(3,) if version >= 3 else (1, 2),
    )
    return Group(where, saved, shardings)


def _check_seal(where: epath.Path, group: str, index: bytes) -> None:
    """The seal beside the group's directory must hold this index's SHA-256:
    else the directory is another checkpoint's (or its index was edited)."""
    path = where.parent / SEAL_FILE.format(group=group)
    problem = None
    try:
        found = _route.read_bounded(path, 1024, lambda what: _damaged(path, what))
    except FileNotFoundError:
        problem = (
            f"{path.name} beside it, which binds it to this checkpoint, is missing"
        )
    except PermissionError:
        raise permission_denied(path) from None
    else:
        if found != seal(index).encode("ascii"):
            problem = (
                f"its index is not the one {path.name} beside it was sealed with: "
                "the directory was copied in from another checkpoint, or its "
                "index was edited"
            )
    if problem is not None:
        raise CheckpointDamagedError(
            f"The arrays saved with orbax_eqx's type handler in {where} do not "
            f"belong to the checkpoint in {where.parent}: {problem}. Restore an "
            "earlier step, or re-save this one (never copy a group directory "
            "between checkpoints)."
        )


def _parse_leaf(name: str, row: Any, packs, version: int, bad) -> LeafMetadata:
    if not isinstance(row, dict):
        raise bad(f"leaf `{name}` is not a JSON object")
    shape, text, data = row.get("shape"), row.get("dtype"), row.get("data")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(_is_size(n) for n in shape)
    ):
        raise bad(f"leaf `{name}` has no valid shape")
    try:
        dtype = parse_dtype(text) if isinstance(text, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None:
        raise bad(f"leaf `{name}` has the unknown dtype {text!r}")
    nbytes = math.prod(shape) * itemsize(dtype)
    if row.get("nbytes") != nbytes:
        raise bad(f"leaf `{name}` records {row.get('nbytes')!r} bytes, not {nbytes}")
    if data not in (PACKED, SHARDS, EMPTY) or (data == EMPTY) != (nbytes == 0):
        raise bad(f"leaf `{name}` has the data kind {data!r}")
    offset = row.get("offset")
    crc, algorithm = _data_sum(name, row, version, bad)
    if data == PACKED:
        if not packs:
            raise bad(f"leaf `{name}` is packed, but the group has no pack")
        if not (_is_size(offset) and offset + nbytes <= packs[0].nbytes):
            raise bad(
                f"leaf `{name}` at offset {offset!r} does not fit in the pack's "
                f"{packs[0].nbytes} bytes"
            )
    path = row.get("path")
    return leaf_metadata(
        name=name,
        path=path if isinstance(path, str) else name,
        kind=ARRAY,
        shape=tuple(shape),
        dtype=text,
        container=JAX,
        data=data,
        nbytes=nbytes,
        pack=0 if data == PACKED else None,
        offset=offset if data == PACKED else None,
        crc32=crc if data == PACKED else None,
        sum_algorithm=algorithm,
    )


def _data_sum(name: str, row: dict, version: int, bad) -> tuple[int | None, str]:
    """A packed leaf's data checksum and its algorithm: from version 3 on an
    XXH3-64 (`"xxh3"`, 16 lower-case hexadecimal digits) and never a CRC-32,
    before it a CRC-32 (`"crc32"`, an integer below 2**32); or none."""
    if version >= 3:
        if "crc32" in row:
            raise bad(
                f'leaf `{name}` records a CRC-32 ("crc32"), which a version-'
                f"{version} index never does: it was edited"
            )
        value = row.get(XXH3)
        if value is not None and not (
            isinstance(value, str) and _HEX64.fullmatch(value)
        ):
            raise bad(
                f"leaf `{name}` has the data checksum {value!r}, not XXH3-64 in "
                "16 lower-case hexadecimal digits"
            )
        return (None if value is None else int(value, 16)), XXH3
    if XXH3 in row:
        raise bad(
            f'leaf `{name}` records an XXH3-64 ("xxh3"), which a version-'
            f"{version} index never does: it was edited"
        )
    crc = row.get("crc32")
    if not (crc is None or (_is_size(crc) and crc < 2**32)):
        raise bad(f"leaf `{name}` has the CRC-32 {crc!r}")
    return crc, CRC32


_HEX64 = re.compile(r"[0-9a-f]{16}")


def _is_size(x: Any) -> TypeGuard[int]:
    return type(x) is int and x >= 0


def _read_bounded(path: epath.Path) -> bytes:
    """The index's bytes; refuses what is missing, not a regular file (a FIFO
    is refused, not waited on), or huge."""
    try:
        return _route.read_bounded(
            path, _MAX_INDEX_BYTES, lambda what: _damaged(path, f"it {what}")
        )
    except FileNotFoundError:
        raise _damaged(path, "it is missing") from None
    except PermissionError:
        raise permission_denied(path) from None


def _damaged(path: epath.Path, what: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The index {path} of arrays saved with orbax_eqx's type handler is "
        f"damaged: {what}. Restore an earlier step, or re-save this one."
    )


@dataclasses.dataclass(frozen=True)
class Request:
    """One array to read: its record, the dtype and where it goes."""

    record: LeafMetadata
    dtype: Any  # target dtype (a cast when it differs from the saved one)
    container: str  # JAX, or NUMPY for a whole host array
    sharding: Any  # target sharding, for JAX


def read(group: Group, requests: dict[str, Request], *, verify: bool = True):
    """Reads the requested leaves of one group: `{name: Request}` to arrays.

    Only the bytes of the requested leaves are read: packed leaves' byte
    ranges, and of sharded ones the ranges each target shard needs.
    """
    packed = {n: r for n, r in requests.items() if r.record.data == PACKED}
    sharded = {n: r for n, r in requests.items() if r.record.data == SHARDS}
    out: dict[str, Any] = {}
    try:
        if packed:
            out.update(
                _packed.read(group.directory, group.saved.packs, packed, verify=verify)
            )
        if sharded:
            out.update(
                _shard_read.read(group.directory, group.saved, sharded, verify=verify)
            )
    except CheckpointDamagedError as e:
        # Their fixes name `verify`, which reads checkpoints with a sidecar only.
        raise CheckpointDamagedError(f"{e} {_NO_VERIFY}") from None
    for name, request in requests.items():
        if request.record.data == EMPTY:
            out[name] = _empty(request)
    return out


_NO_VERIFY = (
    "(Saved through `oeqx.type_handler_registry()`, this checkpoint has no "
    "sidecar, so `verify` cannot read it; a restore checks every byte it reads.)"
)


def _empty(request: Request) -> Any:
    shape = tuple(request.record.shape or ())
    saved = parse_dtype(request.record.dtype)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        zeros = np.zeros(shape + data.shape, data.dtype)
        placed = jax.device_put(zeros, request.sharding)
        return jax.random.wrap_key_data(placed, impl=key_impl(saved))
    zeros = np.zeros(shape, request.dtype)
    if request.container != JAX:
        return zeros
    return jax.make_array_from_callback(shape, request.sharding, lambda i: zeros[i])
