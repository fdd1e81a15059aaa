"""The sidecar's records, read one by one: each decoded by its schema
(`schema`), then checked against what the schema cannot say alone (where
its bytes are, its checksums for its format version), and made into the
objects readers use (`LeafMetadata`, `ModuleInfo`).

A record that fails its schema is damage, worded by the field that failed
(the record is decoded once more, without a schema, only to quote it).
"""

import dataclasses
import functools
import math
import re
import sys
from typing import Any

import msgspec
import numpy as np

from .._tree.names import old_storage_key, storage_key
from .._tree.values import decode_scalar, scalar_type, too_deep
from .._tree.walk import ARRAY, JAX, SCALAR, parse_dtype
from . import compact as _compact
from . import schema as _schema
from .binding import Binder, data_sum_algorithm
from .checksum import NAMES, XXH3
from .sidecar import (
    ALIAS,
    EMPTY,
    KINDS,
    PACKED,
    SHARDS,
    STORED,
    LeafMetadata,
    PackMetadata,
    itemsize,
    leaf_metadata,
)

TOO_DEEP = "nests values deeper than orbax_eqx writes them"
_AT = re.compile(r" - at `\$\.?([A-Za-z_0-9]*)")  # the failing field's name


class Undecodable(Exception):
    """A record holds a number msgspec does not decode (an integer of more
    digits than it takes, a float past the largest): the standard library
    reads the sidecar instead, and says what it makes of it."""


_OUT_OF_RANGE = ("Integer value out of range", "Number out of range")


def decoded(record: Any, kind: Any) -> Any:
    """`record` (decoded already, `msgspec.Raw` bytes, or JSON the standard
    library decoded) as `kind`; raises `msgspec.ValidationError`, or
    `Undecodable`."""
    if isinstance(record, msgspec.Struct | tuple):  # decoded in one pass (a
        return record  # tuple is a row: the standard library makes lists)
    if not isinstance(record, msgspec.Raw):
        return msgspec.convert(record, type=kind)
    try:
        return msgspec.json.decode(record, type=kind)
    except msgspec.ValidationError as e:
        if str(e).startswith(_OUT_OF_RANGE):
            raise Undecodable from None
        raise


def plain(record: Any) -> Any:
    """`record` as plain JSON values, to quote it in an error."""
    if isinstance(record, msgspec.Raw):
        try:
            return msgspec.json.decode(record)
        except (msgspec.DecodeError, RecursionError):
            return None
    return record


def failed_field(error: msgspec.ValidationError) -> str:
    """The top-level field a validation error is about ("" for the record,
    a missing field's name for a missing one)."""
    text = str(error)
    missing = re.match(r"Object missing required field `(\w+)`", text)
    if missing:
        return missing.group(1)
    found = _AT.search(text)
    return found.group(1) if found else ""


@dataclasses.dataclass(frozen=True)
class Sums:
    """What a sidecar says of its leaves' checksums."""

    version: int
    checksums: bool  # False: saved with `checksums=False`
    token: str | None
    # The data checksum of packed leaves (`binding.data_sum_algorithm`).
    algorithm: str = dataclasses.field(init=False)
    # Binds packed leaves' checksums to their records (None: no token).
    binder: Binder | None = dataclasses.field(init=False)

    def __post_init__(self):
        algorithm = data_sum_algorithm(self.version)
        object.__setattr__(self, "algorithm", algorithm)
        binder = None if self.token is None else Binder(self.token, algorithm)
        object.__setattr__(self, "binder", binder)


def leaf(
    name: str,
    record: Any,
    packs: tuple[PackMetadata, ...],
    sums: Sums,
    bad,
    paths: _compact.Paths | None = None,
) -> LeafMetadata:
    """One leaf's record, decoded by its format's schema and checked (from
    format 6 on, a row, or a record whose path `paths` reads off its name)."""
    try:
        rec = decoded(record, _schema.leaf_record(sums.version))
    except msgspec.ValidationError as e:
        raw = plain(record)
        if isinstance(raw, list) and sums.version >= 6:
            raise bad(_row_problem(name, raw, str(e))) from None
        raise bad(_leaf_problem(name, failed_field(e), raw, sums)) from None
    except RecursionError:
        raise bad(f"leaf {name!r} {TOO_DEEP}") from None
    if type(rec) is tuple:  # a row (format 6 on)
        path = paths.of(name) if paths is not None else name
        return _row(name, path, rec, packs, sums, bad)
    path = rec.path
    if path is _schema.UNSET:  # from format 6 on, read off the name
        path = paths.of(name) if paths is not None else name
    if not isinstance(rec, (_schema.ArrayRecord, _schema.ArrayRecord6)):
        kind = KINDS[KINDS.index(type(rec).__struct_config__.tag)]
        value = None if rec.value is _schema.UNSET else rec.value
        if too_deep(value):
            raise bad(f"leaf {name!r} {TOO_DEEP}")
        if kind == SCALAR and (rec.value is _schema.UNSET or not _is_scalar(value)):
            raise bad(f"leaf {name!r} has no valid Python value")
        return leaf_metadata(name, path, kind, value=value)
    return _array(name, path, rec, packs, sums, bad)


def leaves(
    records: dict[str, Any],
    packs: tuple[PackMetadata, ...],
    sums: Sums,
    bad,
    paths: _compact.Paths | None = None,
) -> dict[str, LeafMetadata]:
    """Every leaf's record, in order, read by `leaf`; each dropped from
    `records` once read, so that what a huge sidecar costs in memory stays
    near its records' objects once, not twice. A row decoded already (most
    leaves of a sidecar from format 6 on) goes to `_row` straight."""
    out = {}
    take = records.pop
    of = None if paths is None else paths.of
    for name in list(records):
        record = take(name)
        if type(record) is tuple:  # (what `leaf` does with it, sooner)
            path = name if of is None else of(name)
            out[name] = _row(name, path, record, packs, sums, bad)
        else:
            out[name] = leaf(name, record, packs, sums, bad, paths)
    return out


def _row(name, path, row: tuple, packs, sums: Sums, bad) -> LeafMetadata:
    """A leaf's row (format 6 on, `compact`), read as the array record it
    stands for: a jax array packed in pack 0, of its shape's and dtype's
    bytes, with an XXH3-64 or none (checked as `_array` checks that record,
    written out: most leaves of a sidecar are rows)."""
    text, dims, offset, xxh3 = row
    dtype = sys.intern(text)
    why = _dtype_problem(dtype)
    if why is not None:
        raise bad(f"leaf {name!r} has {why}")
    size = _compact.row_nbytes(dims, dtype)
    if not packs:
        raise bad(f"leaf {name!r} is in pack 0, which is not listed")
    if offset + size > packs[0].nbytes:
        raise bad(
            f"leaf {name!r} ends at byte {offset + size} of pack 0, which "
            f"holds {packs[0].nbytes}"
        )
    crc = None if xxh3 is None else int(xxh3, 16)
    shape = tuple(dims)
    binder = sums.binder
    if crc is not None and sums.version >= 5 and sums.checksums and binder is not None:
        crc = binder.row(crc, name, dtype, shape, offset, size)  # (most rows)
    else:
        crc = _checked_sum(name, path, crc, sums, bad, dtype, dims, 0, offset, size)
    return leaf_metadata(
        name,
        path,
        ARRAY,
        shape,
        dtype,
        JAX,
        PACKED,
        None,
        size,
        pack=0,
        offset=offset,
        crc32=crc,
        sum_algorithm=sums.algorithm,
    )


def _row_problem(name: str, raw: list, error: str) -> str:
    """What is wrong with a leaf's row, by what its schema refused."""
    what = {
        "0": "its dtype is not a string",
        "1": f"its shape is not a list of sizes (at most {_schema.MAX_DIMS})",
        "2": "its offset is not a byte offset (an integer >= 0)",
        "3": "its checksum is not XXH3-64 in 16 lower-case hexadecimal digits "
        "(nor null)",
    }
    at = re.search(r"at `\$\[(\d)\]", error)
    if at is None or len(raw) != 4:
        found = f"{len(raw)} value{'' if len(raw) == 1 else 's'}"
        said = f"it has {found}"
    else:
        said = what[at.group(1)]
    return (
        f"leaf {name!r} is a row, `[dtype, shape, offset, xxh3]` (a packed jax "
        f"array), but {said}"
    )


def _array(name, path, rec, packs, sums: Sums, bad) -> LeafMetadata:
    dtype = sys.intern(rec.dtype)
    why = _dtype_problem(dtype)  # every array's: zero-size and sharded ones too
    if why is not None:
        raise bad(f"leaf {name!r} has {why}")
    shape, data = tuple(rec.shape), rec.data
    _check_location(name, path, rec, shape, bad)
    size = rec.nbytes
    crc32 = None
    if data == PACKED:
        _check_packed(name, shape, dtype, size, rec.pack, rec.offset, packs, bad)
        crc32 = rec.crc32
        if sums.algorithm == XXH3:
            crc32 = None if rec.xxh3 is None else int(rec.xxh3, 16)
        crc32 = _checked_sum(
            name, path, crc32, sums, bad, dtype, rec.shape, rec.pack, rec.offset, size
        )
    elif data == STORED:
        _check_stored(name, path, rec, sums, bad)
    return leaf_metadata(
        name,
        path,
        ARRAY,
        shape,
        dtype,
        rec.container,
        data,
        rec.alias_of,
        size if type(size) is int else 0,
        pack=rec.pack if data == PACKED else None,
        offset=rec.offset if data == PACKED else None,
        crc32=crc32,
        sum32=rec.sum32 if data == STORED and rec.sum32 is not _schema.UNSET else None,
        sharding=str(rec.sharding)
        if data == SHARDS and rec.sharding is not _schema.UNSET
        else None,
        key=rec.key if data == STORED else None,
        sum_algorithm=sums.algorithm,
    )


def _leaf_problem(name: str, field: str, raw: Any, sums: Sums) -> str:
    """What is wrong with a leaf record, by the field its schema refused."""
    got = raw.get(field) if isinstance(raw, dict) else None
    if not isinstance(raw, dict):
        return f"leaf {name!r} is not a JSON object"
    if field == "kind":
        return f"leaf {name!r} has unknown kind {got!r}"
    if field == "path":
        return f"leaf {name!r} has a path that is not a string"
    if field == "shape":
        if isinstance(got, list) and len(got) > _schema.MAX_DIMS:
            return (
                f"leaf {name!r} has a shape of {len(got)} dimensions, where an "
                f"array has at most {_schema.MAX_DIMS}"
            )
        return f"leaf {name!r} has shape {_cut(got)}, not a list of sizes"
    if field == "data":
        return f"leaf {name!r} has unknown data location {got!r}"
    if field == "crc32" and sums.version >= 6:
        return (
            f'leaf {name!r} records a CRC-32 ("crc32"), which a format-'
            f"{sums.version} sidecar never does: it was edited"
        )
    if field in ("crc32", "sum32"):
        return f"leaf {name!r} has {field} {got!r}, not a 32-bit checksum"
    if field == "xxh3":
        return (
            f"leaf {name!r} has data checksum {_cut(got)}, not XXH3-64 in 16 "
            "lower-case hexadecimal digits"
        )
    return f"leaf {name!r} has no valid dtype or container"  # dtype, container


def _checked_sum(
    name, path, crc: int | None, sums: Sums, bad, dtype, shape, pack, offset, size
) -> int | None:
    """A packed leaf's data checksum, as readers compare it with its bytes.

    From format 4 on, a save with checksums records one for every packed
    leaf: one without it was edited, and is damage to a restore as to
    `verify`. From format 5 on it is bound to the leaf's record
    (`binding.bind`): unbound here."""
    version = sums.version
    if version < 4 or not sums.checksums:
        return crc
    if crc is None:
        kind = NAMES[sums.algorithm]
        raise bad(_no_checksum(name, path, "is packed", kind, version))
    if version >= 5 and sums.binder is not None:  # (from format 3 on, always)
        return sums.binder(crc, name, dtype, shape, pack, offset, size)
    return crc


def _check_stored(name, path, rec, sums: Sums, bad) -> None:
    """From format 5 on, a save with checksums records a `sum32` (null where
    no process held the array whole) for every Orbax-stored leaf."""
    if sums.version >= 5 and sums.checksums and rec.sum32 is _schema.UNSET:
        where = "is in Orbax's array store"
        raise bad(_no_checksum(name, path, where, "sum32", sums.version))


def _no_checksum(name: str, path: str, where: str, kind: str, version: int) -> str:
    return (
        f"leaf `{path}` (leaf name {name!r}) {where} but records no "
        f"{kind}, though a format-{version} sidecar of a save with checksums "
        f"records one for every such leaf: it was edited"
    )


def _check_location(name: str, path: str, rec, shape, bad) -> None:
    """Where an array's bytes are, as a save records it."""
    data = rec.data
    if data == STORED and rec.key not in (storage_key(name), old_storage_key(name)):
        # On-disk keys are always derived from names, never read from the file:
        # the file only says which of the two derivations its saver used.
        raise bad(
            f"leaf {name!r} has storage key {rec.key!r}, expected {storage_key(name)!r}"
        )
    if data == ALIAS and not isinstance(rec.alias_of, str):
        raise bad(f"leaf {name!r} is an alias of nothing")
    if data == EMPTY and math.prod(shape) != 0:
        # Else a restore would invent zeros for it, as many as it claims.
        raise bad(
            f'leaf `{path}` (leaf name {name!r}) is stored as zero-size ("data": '
            f'"none") but has shape {tuple(shape)}, which holds '
            f"{math.prod(shape)} elements"
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
    expected = math.prod(shape) * itemsize(parse_dtype(dtype))
    if size != expected:
        raise bad(
            f"leaf {name!r} has {size} bytes in its pack, but a {dtype} array of "
            f"shape {shape} has {expected}"
        )


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


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
