"""Checksums of array data, so that a flipped bit is found, never restored.

Two kinds, by where the bytes are when they can be summed without a copy:

- `crc32` (zlib's CRC-32) for packed arrays: computed from the host copies in
  the pack writer's thread, and from the read buffers on restore. A CRC
  catches every single-bit error, and every burst of up to 32 bits.
- `crc32` of every block of each chunk of a shard pack (sharded arrays;
  blocks sized per chunk, each CRC-32 seeded by where the chunk belongs: see
  `sharded.index`), computed the same way by the process that writes the chunk.
- `sum32` for arrays Orbax stores (`pack=False`): `sum((2 * i + 1) * word_i)
  mod 2**32` over the array's 32-bit words `word_i` in C order (each element
  as the unsigned integer of its bits, zero-extended to 32 bits; 64-bit and
  complex elements as two words, low first), computed on host (`host_sum32`)
  from a copy taken when `save` is called, where one process holds the whole
  array, and from the restored array the same way. A single-bit flip changes
  it by an odd multiple of a power of two below 2**32, so every one is
  caught; it does not depend on the sharding, so a restore onto another mesh
  checks it too. (Before orbax_eqx 0.2 it was computed on the devices; the
  value is the same.)

And one for records: `digest` of the sidecar's own bytes (from format 6 on),
written with the name of its algorithm (`"xxh3:9f2c41d07a3be865"`), so that every
record a restore trusts (a Python value, an alias, a `Shared` wiring, a
static field, a leaf's record, the pack table) is covered, and a reader
knows which algorithm to check it with. It is computed only here: changing
the algorithm is changing `DIGEST` (and adding it to `_DIGESTS`).

Nothing here runs on a device: a checkpoint library that dispatches
computations over sharded arrays issues collectives per leaf, which on CPU
devices can deadlock and across hosts adds a lock-step Orbax does not have.
"""

import zlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import xxhash

from .._errors import CheckpointDamagedError, bullet_list

_CHUNK = 1 << 22  # elements summed at a time by numpy


# The algorithms a record's digest may name, and the one a save uses.
_DIGESTS = {
    "crc32": lambda data: f"{zlib.crc32(data):08x}",
    "xxh3": lambda data: f"{xxhash.xxh3_64_intdigest(data):016x}",
}
DIGEST = "xxh3"  # XXH3-64: at memory speed (see `XXH3` below)


def digest(data: bytes | memoryview, algorithm: str = DIGEST) -> str:
    """The checksum of records (a sidecar's bytes) as written: `algorithm:hex`.

    The one function that computes it: a new algorithm is a new entry of
    `_DIGESTS` and a new `DIGEST`. Raises `ValueError` for an algorithm it
    does not know.
    """
    compute = _DIGESTS.get(algorithm)
    if compute is None:
        raise ValueError(
            f"unknown checksum algorithm {algorithm[:40]!r} (this orbax_eqx knows "
            f"{', '.join(sorted(_DIGESTS))})"
        )
    return f"{algorithm}:{compute(data)}"


def crc32(data: np.ndarray | memoryview, start: int = 0) -> int:
    """CRC-32 of an array's bytes in C order (continuing from `start`)."""
    if isinstance(data, np.ndarray):
        data = data.reshape(-1).view(np.uint8).data
    return zlib.crc32(data, start)


# What a packed leaf's data checksum is, by the name a sidecar gives it:
# CRC-32 (formats 1-5) or XXH3-64 (format 6 on: measured on the 2-vCPU test
# machine, one thread, ~20 GB/s against zlib's CRC-32 at ~3.3 GB/s and memcpy
# at ~10 GB/s; see BENCHMARKS.md, "Checksums at memory speed").
CRC32 = "crc32"
XXH3 = "xxh3"
NAMES = {CRC32: "CRC-32", XXH3: "XXH3-64"}


class Running:
    """A data checksum summed a piece at a time, in order (`algorithm`: `CRC32`
    or `XXH3`; both release the GIL over large pieces)."""

    __slots__ = ("algorithm", "_crc", "_hasher")

    def __init__(self, algorithm: str = CRC32):
        if algorithm not in NAMES:
            raise ValueError(f"unknown data checksum {algorithm!r}")
        self.algorithm = algorithm
        self._crc = 0
        self._hasher = xxhash.xxh3_64() if algorithm == XXH3 else None

    def update(self, data: np.ndarray | memoryview) -> None:
        if isinstance(data, np.ndarray):
            data = data.reshape(-1).view(np.uint8).data
        if self._hasher is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._hasher.update(data)

    def value(self) -> int:
        return self._crc if self._hasher is None else self._hasher.intdigest()


def data_sum(data: np.ndarray | memoryview, algorithm: str = CRC32) -> int:
    """The checksum `algorithm` of an array's bytes in C order: what
    `Running` sums of them in one piece, in one call (a save sums every
    packed leaf: 1.1 us a small one, against 2.2 through `Running`)."""
    if isinstance(data, np.ndarray):
        data = data.reshape(-1).view(np.uint8).data
    if algorithm == XXH3:
        return xxhash.xxh3_64_intdigest(data)  # (releases the GIL, as `update`)
    if algorithm == CRC32:
        return zlib.crc32(data)
    raise ValueError(f"unknown data checksum {algorithm!r}")


def seeded(data: bytes | memoryview, seed: int, algorithm: str) -> int:
    """The checksum `algorithm` of `data` started from `seed`: a CRC-32
    continued from `seed`, an XXH3-64 with `seed` as its seed (the shard
    indexes' block checksums, bound to where their bytes belong)."""
    if algorithm == XXH3:
        return xxhash.xxh3_64_intdigest(data, seed)
    return zlib.crc32(data, seed)


# Held one per byte by numpy: integers by value, floats by their 4-bit pattern.
_SUB_BYTE_INTS = ("int4", "uint4", "int2", "uint2")
_SUB_BYTE_FLOATS = ("float4_e2m1fn",)


def host_sum32(x: np.ndarray) -> int:
    """`sum32` of a host array (typed PRNG keys: of their key data), in numpy."""
    flat = np.ascontiguousarray(x).reshape(-1)
    total, first = 0, 0  # `first`: index of the chunk's first word
    for start in range(0, flat.size, _CHUNK):
        words = _host_words(flat[start : start + _CHUNK]).reshape(-1)
        index = np.arange(first, first + words.size, dtype=np.uint64)
        weights = (index * 2 + 1).astype(np.uint32)  # mod 2**32
        total += int(np.sum(words * weights, dtype=np.uint32))
        first += words.size
    return total % 2**32


def _host_words(x: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.complexfloating):
        x = np.stack([x.real, x.imag], axis=-1)
    name = x.dtype.name
    if name in _SUB_BYTE_FLOATS:
        x = x.view(ml_dtypes.uint4).astype(np.uint8)
    elif name in _SUB_BYTE_INTS:
        x = x.astype(np.int8 if name.startswith("int") else np.uint8)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}
    # 8-byte elements as two words, low first (numpy views bytes as they are).
    return x.view(unsigned[x.dtype.itemsize]).astype(np.uint32, copy=False)


def mismatch(record: Any, kind: str, recorded: int, found: int) -> str:
    """One line of a checksum error, leaf path first."""
    digits = 18 if kind == NAMES[XXH3] else 10  # 64 bits: 16 hexadecimal digits
    return (
        f"Leaf `{record.path}` ({record.name}): {kind} recorded at save "
        f"{recorded:#0{digits}x}, computed from the data now {found:#0{digits}x}."
    )


def damaged(directory: Any, problems: Sequence[str]) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The data of {len(problems)} leaf(s) of the checkpoint in {directory} "
        "changed after it was saved (a flipped bit on disk, or a damaged copy; "
        "or its sidecar record was edited):\n"
        + bullet_list(problems)
        + "\nRestore an earlier step (`oeqx.restore_latest` falls back past "
        "damaged steps); `python -m orbax_eqx verify PATH` checks every leaf."
    )
