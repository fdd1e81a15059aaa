"""Reading the sidecar: validating its JSON and turning it into `Metadata`.

Pure data: nothing named in the file is imported or called, and every file
name and storage key is derived (from the token, from leaf names) and only
compared with what the file says. The format is described in `sidecar`.

From format 6 on, the file's checksum is checked first, before its JSON is
read (see `sidecar.checksum_line`): any changed byte is damage.

Reading is bounded: the file must be a regular file (a FIFO would block the
read forever, a link to `/dev/zero` would never end) of at most `MAX_BYTES`;
its JSON may hold no `NaN`/`Infinity` (which orbax_eqx never writes) and no
integer of more digits than Python converts, and its values may nest at most
`values.MAX_DEPTH` levels deep, so that reading, comparing or printing them
never recurses without bound. Any of these is damage, said in one
`SidecarError`.
"""

import dataclasses
import functools
import json
import math
import re
import sys
from typing import Any

import numpy as np
from etils import epath

# The one module of a later stage read here: it imports nothing of ours but
# `_errors`, and opening files safely is the same job for every file.
from .._bytes import route as _route
from .._errors import SidecarError, permission_denied
from .._gc import paused
from .._tree import nodes as _nodes
from .._tree.names import old_storage_key, storage_key
from .._tree.values import decode_scalar, scalar_type, too_deep
from .._tree.walk import ARRAY, SCALAR, ModuleInfo, parse_dtype
from . import sealed as _sealed
from .checksum import NAMES, XXH3
from .sidecar import (
    ALIAS,
    CONTAINERS,
    EMPTY,
    FILE_NAME,
    FORMAT,
    FORMAT_VERSION,
    KINDS,
    MAX_BYTES,
    PACKED,
    SHARDS,
    STORED,
    TOKEN,
    LeafMetadata,
    Metadata,
    PackMetadata,
    bind,
    data_sum_algorithm,
    itemsize,
    pack_file,
)

_HEX64 = re.compile(r"[0-9a-f]{16}")  # a 64-bit checksum as format 6 writes it
_MAX_DIM = 2**62  # past this, a shape is no array any numpy can make


class _NotJSON(ValueError):
    """`NaN` or `Infinity`, which Python's reader takes but JSON has not."""


def read(directory: epath.Path) -> Metadata:
    """Reads and validates the sidecar of the checkpoint in `directory`."""
    path = directory / FILE_NAME
    missing = SidecarError(
        f"{path} is missing, so {directory} is not an orbax_eqx checkpoint "
        "or is incomplete. Pass the item directory of a checkpoint saved "
        "with orbax_eqx (for a CheckpointManager: <root>/<step>/<item>)."
    )
    if not path.exists():
        if (directory / "_METADATA").exists():  # Orbax's PyTree handlers wrote it
            raise SidecarError(
                f"{directory} is a plain Orbax checkpoint (saved by Orbax's own "
                "handlers, with no orbax_eqx sidecar): it holds arrays only. "
                "`oeqx.restore(path, skeleton)` restores it into a skeleton; "
                "saving that with `oeqx.save` makes an orbax_eqx checkpoint."
            )
        raise missing
    try:
        raw = _route.read_bounded(path, MAX_BYTES, lambda what: _damaged(path, what))
    except FileNotFoundError:  # deleted since, or a link to nothing
        raise missing from None
    except PermissionError:
        raise permission_denied(path) from None
    try:
        damaged = functools.partial(_damaged, path)
        sealed = _sealed.check(raw, damaged)
        with paused():  # objects per leaf: see `_gc`
            content = _loads(raw, path)
            del raw  # held no longer than needed: a sidecar may be 256 MiB
            _sealed.check_sealed(content, sealed, FORMAT_VERSION, damaged)
            return parse(content, str(directory))
    except RecursionError:  # printing a value in an error, say
        raise _damaged(path, _TOO_DEEP) from None


_TOO_DEEP = "nests values deeper than orbax_eqx writes them"


def _damaged(path, what: str) -> SidecarError:
    return SidecarError(
        f"The sidecar {path} {what}; the checkpoint is damaged (or something "
        "else was put in its place). Restore an earlier step, or re-save it."
    )


def _loads(raw: bytes, path) -> Any:
    try:
        # `surrogatepass`: sidecars from before such text was refused at save
        # hold lone surrogates, UTF-8-encoded; they read back exactly.
        return json.loads(
            raw.decode("utf-8", "surrogatepass"), parse_constant=_no_constant
        )
    except RecursionError:
        raise _damaged(path, _TOO_DEEP) from None
    except _NotJSON as e:
        raise _damaged(path, f"holds {e}, which JSON does not have") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SidecarError(
            f"The sidecar {path} is not valid JSON ({e}); the checkpoint is "
            "damaged. Restore an earlier step."
        ) from None
    except ValueError:  # the only other: an int past Python's digit limit
        raise _damaged(
            path,
            "holds an integer of more than "
            f"{sys.get_int_max_str_digits()} digits, which orbax_eqx never "
            "writes (it writes long integers in hexadecimal)",
        ) from None


def _no_constant(name: str) -> Any:
    raise _NotJSON(name)


def parse(content: Any, where: str) -> Metadata:
    """Validates sidecar JSON and turns it into `Metadata`."""

    def bad(what: str) -> SidecarError:
        return SidecarError(
            f"The sidecar in {where} is damaged: {what}. Restore an earlier step, "
            "or re-save the checkpoint."
        )

    version = _version(content, where, bad)
    versions = content.get("versions", {})
    leaves_json = content.get("leaves")
    modules_json = content.get("modules", {})
    if not isinstance(versions, dict) or not isinstance(leaves_json, dict):
        raise bad('"leaves" and "versions" must be JSON objects')
    if not all(isinstance(v, str) for v in versions.values()):
        raise bad('"versions" must map package names to version strings')
    if not isinstance(modules_json, dict):
        raise bad('"modules" must be a JSON object')
    checksums = content.get("checksums", True)
    if type(checksums) is not bool:
        raise bad('"checksums" must be true or false')
    token = content.get("token")
    if version >= 3 and not (isinstance(token, str) and TOKEN.fullmatch(token)):
        raise bad(f"token {token!r} is not 16 hexadecimal digits")
    if version < 3:
        token = None
    packs = _parse_packs(content.get("packs", []), token, where, bad)
    shard_files = content.get("shard_files", 0)
    if not _is_size(shard_files):
        raise bad(f'"shard_files" is {shard_files!r}, not a count of files')
    sums = _Sums(version, checksums, token)
    leaves = {}
    # Each record is dropped once read, so that what a huge sidecar costs in
    # memory stays near its records' objects once, not twice.
    for name in list(leaves_json):
        leaves[name] = _parse_leaf(name, leaves_json.pop(name), packs, bad, sums)
    _check_references(leaves, token is not None and shard_files != 0, bad)
    modules = _parse_modules(modules_json, bad)
    nodes = None
    if version >= 5 and "nodes" in content:
        nodes = _parse_nodes(content["nodes"], bad)
    return Metadata(
        where,
        version,
        dict(versions),
        leaves,
        modules,
        packs,
        token,
        shard_files,
        checksums,
        nodes,
    )


def _version(content: Any, where: str, bad) -> int:
    """The sidecar's format version, one this orbax_eqx reads."""
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise bad(f'expected a JSON object with "format": "{FORMAT}"')
    version = content.get("format_version")
    if type(version) is not int:
        raise bad('"format_version" is not an integer')
    if version < 1:
        raise bad(
            f'"format_version" is {version}, which no orbax_eqx ever wrote (they '
            f"write 1 to {FORMAT_VERSION})"
        )
    if version > FORMAT_VERSION:
        raise SidecarError(
            f"The checkpoint in {where} has sidecar format version {version}, but "
            f"this orbax_eqx reads versions up to {FORMAT_VERSION}. Upgrade "
            "orbax_eqx to restore it."
        )
    return version


def _check_references(leaves: dict, has_shards: bool, bad) -> None:
    """Aliases name stored arrays of their shape and dtype; leaves in shard
    packs have packs listed."""
    for leaf in leaves.values():
        target = leaves.get(leaf.alias_of) if leaf.data == ALIAS else None
        if leaf.data == ALIAS and (
            target is None
            or target.data not in (STORED, PACKED, SHARDS)
            or (target.shape, target.dtype) != (leaf.shape, leaf.dtype)
        ):
            raise bad(
                f"leaf {leaf.name!r} is an alias of {leaf.alias_of!r}, "
                "which is no stored array of the same shape and dtype"
            )
        if leaf.data == SHARDS and not has_shards:
            raise bad(
                f"leaf {leaf.name!r} is in shard packs, but the sidecar lists "
                'none (no token, or "shard_files": 0)'
            )


def _parse_modules(modules_json: dict, bad) -> dict[str, ModuleInfo]:
    modules = {}
    for name, rec in modules_json.items():
        if not (
            isinstance(rec, dict)
            and isinstance(rec.get("class"), str)
            and isinstance(rec.get("static", {}), dict)
            and isinstance(rec.get("path", name), str)
        ):
            raise bad(f"module {name!r} has no class, path or static fields")
        static = rec.get("static", {})
        for field, value in static.items():
            if too_deep(value):
                raise bad(f"static field {field!r} of module {name!r} {_TOO_DEEP}")
        modules[name] = ModuleInfo(rec.get("path", name), rec["class"], static)
    return modules


def _parse_nodes(nodes_json: Any, bad) -> dict[str, dict[str, Any]]:
    """The records of the tree's inner nodes, checked for shape only: how they
    refer to each other is checked by the rebuild that reads them."""
    if not isinstance(nodes_json, dict):
        raise bad('"nodes" must be a JSON object')
    for name, rec in nodes_json.items():
        if not (
            isinstance(rec, dict)
            and rec.get("type") in _nodes.TYPES
            and isinstance(rec.get("path"), str)
            and all(isinstance(rec.get(k, []), list) for k in ("children", "fields"))
            and all(c is None or isinstance(c, str) for c in rec.get("children", []))
            and all(isinstance(f, str) for f in rec.get("fields", []))
            and isinstance(rec.get("class", ""), str)
        ):
            raise bad(f"node {name!r} has no valid type, path or children")
        for key in ("keys", "markers"):
            if not isinstance(rec.get(key, []), list) or too_deep(rec.get(key)):
                raise bad(f"the {key} of node {name!r} are malformed")
    return nodes_json


def _parse_packs(packs_json: Any, token, where, bad) -> tuple[PackMetadata, ...]:
    if not isinstance(packs_json, list):
        raise bad('"packs" must be a JSON list')
    packs = []
    for i, rec in enumerate(packs_json):
        if not isinstance(rec, dict) or not _is_size(rec.get("nbytes")):
            raise bad(f"pack {i} has no size")
        if rec.get("file") != pack_file(token, i):
            # Like storage keys, file names are derived, never read from the file.
            raise bad(
                f"pack {i} is in file {rec.get('file')!r}, expected "
                f"{pack_file(token, i)!r}"
            )
        if rec.get("byteorder", sys.byteorder) != sys.byteorder:
            raise SidecarError(
                f"The arrays of the checkpoint in {where} were packed on a "
                f"{rec['byteorder']}-endian machine; this one is {sys.byteorder}-"
                "endian, which orbax_eqx does not convert."
            )
        packs.append(PackMetadata(rec["file"], rec["nbytes"]))
    return tuple(packs)


@functools.cache
def _dtype_problem(text: str) -> str | None:
    """What is wrong with an array's recorded dtype, or None: it must be
    spelled as a save spells it (`str(dtype)`: `<U2`, not `U2`), and be one a
    save writes (no structured or object dtype)."""
    try:
        dtype = parse_dtype(text)
    except (TypeError, ValueError, OverflowError, MemoryError, SyntaxError):
        return f"unknown dtype {text!r}"
    if isinstance(dtype, np.dtype) and (
        dtype.fields is not None or dtype.subdtype is not None
    ):
        return f"unknown dtype {text!r}"
    if isinstance(dtype, np.dtype) and dtype.hasobject:
        return f"dtype {text!r}, which no save writes (it refuses arrays of objects)"
    if str(dtype) != text:
        return f"dtype {text!r}, which no save writes (it writes {str(dtype)!r})"
    return None


def _is_size(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_scalar(encoded: Any) -> bool:
    if scalar_type(encoded) is None:
        return False
    try:
        decode_scalar(encoded)
    except (TypeError, ValueError):  # `{"complex": 5}`: no pair to unpack
        return False
    return True


def _check_location(name: str, path: str, rec: dict, data, shape, bad) -> None:
    """Where an array's bytes are, as a save records it."""
    if data == STORED and rec.get("key") not in (
        storage_key(name),
        old_storage_key(name),
    ):
        # On-disk keys are always derived from names, never read from the file:
        # the file only says which of the two derivations its saver used.
        raise bad(
            f"leaf {name!r} has storage key {rec.get('key')!r}, expected "
            f"{storage_key(name)!r}"
        )
    if data == ALIAS and not isinstance(rec.get("alias_of"), str):
        raise bad(f"leaf {name!r} is an alias of nothing")
    if data not in (STORED, PACKED, SHARDS, EMPTY, ALIAS):
        raise bad(f"leaf {name!r} has unknown data location {data!r}")
    if data == EMPTY and math.prod(shape) != 0:
        # Else a restore would invent zeros for it, as many as it claims.
        raise bad(
            f'leaf `{path}` (leaf name {name!r}) is stored as zero-size ("data": '
            f'"none") but has shape {tuple(shape)}, which holds '
            f"{math.prod(shape)} elements"
        )


def _recorded_sums(name: str, rec: dict, checks: "_Sums", bad) -> dict:
    """The leaf's recorded checksums: `crc32` (the data's, whatever the
    algorithm: XXH3-64 from format 6 on) and `sum32`."""
    sums = {k: rec.get(k) for k in ("crc32", "sum32")}
    for k, v in sums.items():
        if v is not None and not (_is_size(v) and v < 2**32):
            raise bad(f"leaf {name!r} has {k} {v!r}, not a 32-bit checksum")
    if checks.algorithm == XXH3:  # format 6 on: 16 hexadecimal digits, never `crc32`
        text = rec.get(XXH3)
        if sums["crc32"] is not None:
            raise bad(
                f'leaf {name!r} records a CRC-32 ("crc32"), which a format-'
                f"{checks.version} sidecar never does: it was edited"
            )
        if not (text is None or (isinstance(text, str) and _HEX64.fullmatch(text))):
            raise bad(
                f"leaf {name!r} has data checksum {_cut(text)}, not XXH3-64 in 16 "
                "lower-case hexadecimal digits"
            )
        sums["crc32"] = None if text is None else int(text, 16)
    return sums


def _parse_leaf(name: str, rec: Any, packs, bad, checks: "_Sums") -> LeafMetadata:
    if not isinstance(rec, dict):
        raise bad(f"leaf {name!r} is not a JSON object")
    kind = rec.get("kind")
    if kind not in KINDS:
        raise bad(f"leaf {name!r} has unknown kind {kind!r}")
    kind = KINDS[KINDS.index(kind)]  # one string for all leaves, not one each
    path = rec.get("path", name)
    if not isinstance(path, str):
        raise bad(f"leaf {name!r} has a path that is not a string")
    if kind != ARRAY:
        value = rec.get("value")
        if too_deep(value):
            raise bad(f"leaf {name!r} {_TOO_DEEP}")
        if kind == SCALAR and not _is_scalar(rec.get("value", ...)):
            raise bad(f"leaf {name!r} has no valid Python value")
        return LeafMetadata(name, path, kind, value=value)
    shape = rec.get("shape")
    if not (
        isinstance(shape, list)
        and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)
    ):
        raise bad(f"leaf {name!r} has shape {shape!r}, not a list of sizes")
    dtype, cont, data = rec.get("dtype"), rec.get("container"), rec.get("data")
    if not isinstance(dtype, str) or cont not in CONTAINERS:
        raise bad(f"leaf {name!r} has no valid dtype or container")
    dtype, cont = sys.intern(dtype), CONTAINERS[CONTAINERS.index(cont)]
    why = _dtype_problem(dtype)  # every array's: zero-size and sharded ones too
    if why is not None:
        raise bad(f"leaf {name!r} has {why}")
    _check_location(name, path, rec, data, shape, bad)
    size = rec.get("nbytes", 0)
    pack, offset = rec.get("pack"), rec.get("offset")
    if data == PACKED:
        _check_packed(name, tuple(shape), dtype, size, pack, offset, packs, bad)
    sums = _recorded_sums(name, rec, checks, bad)
    algorithm = checks.algorithm
    leaf = LeafMetadata(
        name,
        path,
        kind,
        tuple(shape),
        dtype,
        cont,
        data,
        rec.get("alias_of"),
        size if type(size) is int else 0,
        pack=pack if data == PACKED else None,
        offset=offset if data == PACKED else None,
        crc32=sums["crc32"] if data == PACKED else None,
        sum32=sums["sum32"] if data == STORED else None,
        sharding=str(rec["sharding"]) if data == SHARDS and "sharding" in rec else None,
        key=rec["key"] if data == STORED else None,
        sum_algorithm=algorithm,
    )
    return checks.check(leaf, rec, bad)


@dataclasses.dataclass(frozen=True)
class _Sums:
    """What a sidecar says of its leaves' checksums."""

    version: int
    checksums: bool  # False: saved with `checksums=False`
    token: str | None

    @property
    def algorithm(self) -> str:
        """The data checksum of packed leaves (`sidecar.data_sum_algorithm`)."""
        return data_sum_algorithm(self.version)

    def check(self, leaf: LeafMetadata, rec: dict, bad) -> LeafMetadata:
        """From format 4 on, a save with checksums records a CRC-32 for every
        packed leaf, and from format 5 on a `sum32` (null where no process held
        the array whole) for every Orbax-stored one: one without it was edited,
        and is damage to a restore as to `verify`. From format 5 on, each
        CRC-32 is bound to its record (`sidecar.bind`): unbound here, so that
        readers compare it with the CRC-32 of the bytes."""
        version = self.version
        if version < 4 or not self.checksums:
            return leaf
        if leaf.data == STORED and version >= 5 and "sum32" not in rec:
            raise bad(_no_checksum(leaf, "is in Orbax's array store", "sum32", version))
        if leaf.data != PACKED:
            return leaf
        if leaf.crc32 is None:
            kind = NAMES[self.algorithm]
            raise bad(_no_checksum(leaf, "is packed", kind, version))
        if version >= 5:
            assert self.token is not None  # `parse` checked it from format 3 on
            crc = bind(leaf.crc32, self.token, leaf.name, rec, self.algorithm)
            # The record was made just now and is seen by nothing else yet:
            # set in place (`dataclasses.replace` per leaf cost ~10 us).
            object.__setattr__(leaf, "crc32", crc)
        return leaf


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _no_checksum(leaf, where: str, kind: str, version: int) -> str:
    return (
        f"leaf `{leaf.path}` (leaf name {leaf.name!r}) {where} but records no "
        f"{kind}, though a format-{version} sidecar of a save with checksums "
        f"records one for every such leaf: it was edited"
    )


def _check_packed(name, shape, dtype, size, pack, offset, packs, bad) -> None:
    """A packed leaf's bytes must lie inside its pack and fit its shape exactly."""
    if not (_is_size(pack) and pack < len(packs)):
        raise bad(f"leaf {name!r} is in pack {pack!r}, which is not listed")
    if not (_is_size(offset) and _is_size(size)):
        raise bad(f"leaf {name!r} has no valid offset and size in its pack")
    if offset + size > packs[pack].nbytes:
        raise bad(
            f"leaf {name!r} ends at byte {offset + size} of pack {pack}, which "
            f"holds {packs[pack].nbytes}"
        )
    try:
        expected = math.prod(shape) * itemsize(parse_dtype(dtype))
    except (TypeError, ValueError):
        raise bad(f"leaf {name!r} has unknown dtype {dtype!r}") from None
    if size != expected:
        raise bad(
            f"leaf {name!r} has {size} bytes in its pack, but a {dtype} array of "
            f"shape {shape} has {expected}"
        )
