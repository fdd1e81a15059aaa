"""Packed leaves' data checksums in the sidecar, bound to their records.

From format 5 on, a packed leaf's recorded checksum is the checksum of its
bytes XOR the checksum of what says where and what they are (`bind`), so an
edited record is found as damaged data would be. Which algorithm a format
records is `data_sum_algorithm`: CRC-32 up to format 5, XXH3-64 from 6 on.
The checksums of the bytes themselves are computed in `_storage`, with
`checksum.py`'s functions.
"""

import json
import zlib
from typing import Any

import xxhash

from .checksum import CRC32, XXH3
from .compact import row_nbytes
from .sidecar import STORED, pack_file


def data_sum_algorithm(version: int) -> str:
    """The checksum of packed leaves' bytes a sidecar of format `version`
    records: CRC-32 (`"crc32"`, an integer) up to format 5, XXH3-64 (`"xxh3"`,
    16 hexadecimal digits) from format 6 on."""
    return XXH3 if version >= 6 else CRC32


def record_checksums(content: dict[str, Any], crc32: dict, sum32: dict) -> None:
    """Adds `{leaf name: checksum}` to the sidecar's JSON `content`, in place
    (packed leaves' data checksums, of `data_sum_algorithm`, bound to their
    records: see `bind`)."""
    leaves = content["leaves"]
    algorithm = data_sum_algorithm(content["format_version"])
    binder = Binder(content["token"], algorithm)
    for name, value in crc32.items():
        record = leaves[name]
        if type(record) is list:  # a row (format 6 on, `compact`)
            dtype, shape, offset, _ = record
            size = row_nbytes(shape, dtype)
            bound = binder(value, name, dtype, shape, 0, offset, size)
            record[3] = f"{bound:016x}"
            continue
        bound = binder.record(value, name, record)
        if algorithm == XXH3:
            record[XXH3] = f"{bound:016x}"
        else:
            record[CRC32] = bound
    for name, value in sum32.items():
        leaves[name]["sum32"] = value
    if content.get("checksums", True):
        # Format 5: an Orbax-stored array that no process held whole at save
        # (multi-host) has no sum32, and says so; a missing one was edited.
        for record in leaves.values():
            if type(record) is dict and record.get("data") == STORED:
                record.setdefault("sum32", None)


def bind(
    crc: int, token: str, name: str, record: dict[str, Any], algorithm: str = CRC32
) -> int:
    """A packed leaf's checksum as formats 5 on record it: the checksum of its
    bytes XOR the checksum (the same algorithm: CRC-32 in format 5, XXH3-64
    from format 6 on) of what says where and what they are (the save's token,
    the leaf name, dtype, shape, pack file, offset and size). Its own inverse:
    a reader binds the recorded value with the record as it reads it, and
    gets the CRC-32 of the bytes back only if no part of that was edited
    (a dtype or shape of the same size, an offset, another leaf's record, a
    pack of another save); else the data is found damaged, by a restore and by
    `verify` alike. (`Binder` binds the leaves of one sidecar sooner.)"""
    return Binder(token, algorithm).record(crc, name, record)


class Binder:
    """`bind` for the leaves of one save: what is the same for all of them
    (the token, the pack files' names, the dtypes' spellings) is written once,
    so that binding a leaf costs ~1 us, not ~3 (a sidecar of 50,000 leaves
    is read 0.1 s sooner)."""

    def __init__(self, token: str, algorithm: str = CRC32):
        self.token = token
        self._sum = xxhash.xxh3_64_intdigest if algorithm == XXH3 else zlib.crc32
        self._head = f"[{_string(token)}," if type(token) is str else None
        self._strings: dict[str, str] = {}  # a dtype or a file: its JSON
        self._files: dict[int, str] = {}  # a pack: its file's name
        self._middles: dict[tuple, str] = {}  # see `row`

    def record(self, crc: int, name: str, record: dict[str, Any]) -> int:
        """`crc` bound to the leaf `name` of a sidecar record (a dict)."""
        return self(
            crc,
            name,
            record["dtype"],
            record["shape"],
            record["pack"],
            record["offset"],
            record["nbytes"],
        )

    def __call__(self, crc, name, dtype, shape, pack, offset, size) -> int:
        """`crc` bound to the leaf `name` of that dtype, shape, pack (its
        index), offset and size."""
        file = self._files.get(pack) if type(pack) is int else None
        if file is None:
            file = pack_file(self.token, pack)
            if type(pack) is int:
                self._files[pack] = file
        text = self.text(name, dtype, list(shape), file, offset, size)
        return crc ^ self._sum(text.encode("utf-8", "surrogatepass"))

    def row(self, crc: int, name: str, dtype: str, shape: tuple, offset: int, size):
        """`self(crc, name, dtype, shape, 0, offset, size)`: a row's leaf (in
        pack 0, format 6 on), with the text's middle (dtype, shape, file)
        written once per dtype and shape: most leaves of a model share a few.
        The same text (`tests/test_sidecar_checksums.py`), ~2x sooner."""
        middle = self._middles.get((dtype, shape))
        if middle is None:
            if not (
                self._head is not None
                and type(dtype) is str
                and type(shape) is tuple
                and _INT.issuperset(map(type, shape))
                and len(self._middles) < _MAX_MIDDLES  # (a hostile file's many)
            ):
                return self(crc, name, dtype, shape, 0, offset, size)
            dims = repr(list(shape)).replace(" ", "")
            file = _string(pack_file(self.token, 0))
            middle = self._middles[dtype, shape] = f"{_string(dtype)},{dims},{file}"
        if not (type(name) is str and type(offset) is int and type(size) is int):
            return self(crc, name, dtype, shape, 0, offset, size)
        text = f"{self._head}{_string(name)},{middle},{offset},{size}]"
        return crc ^ self._sum(text.encode("utf-8", "surrogatepass"))

    def text(self, name, dtype, shape, file, offset, size) -> str:
        """`json.dumps([token, name, dtype, shape, file, offset, size],
        ensure_ascii=False, separators=(",", ":"))`, the text `bind` sums.

        Written out where every value is of the type a save records (strings,
        and plain ints: a bool or a float would print otherwise), which is
        ~4x faster than the encoder; anything else goes through the encoder,
        so the text is the same either way (`tests/test_sidecar_checksums.py`)."""
        strings = self._strings
        if (
            self._head is not None
            and type(offset) is int
            and type(size) is int
            and type(shape) is list
            and _INT.issuperset(map(type, shape))
            and type(name) is str
            and type(dtype) is str
            and type(file) is str
        ):
            dims = repr(shape).replace(" ", "")  # a list of ints: "[8,8]"
            spelled = strings.get(dtype)
            if spelled is None:
                spelled = strings[dtype] = _string(dtype)
            where = strings.get(file)
            if where is None:
                where = strings[file] = _string(file)
            return (
                f"{self._head}{_string(name)},{spelled},{dims},{where},{offset},{size}]"
            )
        values = [self.token, name, dtype, shape, file, offset, size]
        return _BIND_ENCODER.encode(values)


_INT = frozenset([int])
_MAX_MIDDLES = 4096  # dtypes and shapes `Binder.row` keeps the text of
# What `_BIND_ENCODER` writes for a string (`ensure_ascii=False`).
_string = json.encoder.encode_basestring
# One encoder for all leaves (`json.dumps` with options makes one per call).
_BIND_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
