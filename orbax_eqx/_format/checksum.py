"""Checksums (docs/guides/format.md): XXH3-64 of packed leaves' bytes and of
shard-pack blocks, `sum32` of arrays Orbax stores (`pack=False`: independent
of the sharding, so a restore onto another mesh checks it too), and `digest`
of a JSON file's bytes, its last line (`sealed`). All computed on host from
the bytes written or read: nothing here runs on a device.
"""

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import xxhash

from .._errors import FALL_BACK, CheckpointDamagedError, bullet_list

DIGEST = "xxh3"
NAME = "XXH3-64"
_CHUNK = 1 << 22  # elements summed at a time by numpy


def _flat(data: np.ndarray | memoryview | bytes) -> Any:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return data


def xxh3(data: np.ndarray | memoryview | bytes) -> int:
    """XXH3-64 of an array's bytes in C order (or of bytes)."""
    return xxhash.xxh3_64_intdigest(_flat(data))


class Running:
    """XXH3-64 summed a piece at a time, in order."""

    __slots__ = ("_hasher",)

    def __init__(self):
        self._hasher = xxhash.xxh3_64()

    def update(self, data: np.ndarray | memoryview) -> None:
        self._hasher.update(_flat(data))

    def value(self) -> int:
        return self._hasher.intdigest()


def identity(data: np.ndarray | memoryview) -> str:
    """What a dedup save compares (a packed leaf, a chunk of a shard pack):
    the XXH3-128 of the bytes, as 32 hex digits."""
    return f"{xxhash.xxh3_128_intdigest(_flat(data)):032x}"


def _low_half_is_xxh3() -> bool:
    """Whether the low 64 bits of XXH3-128 are XXH3-64 for inputs of more
    than 240 bytes, as XXH3's reference implementation makes them."""
    samples = (bytes(range(256)) * 4, b"\0" * 241, bytes(range(241, 0, -1)) * 9)
    return all(
        xxhash.xxh3_64_intdigest(b) == xxhash.xxh3_128_intdigest(b) & (2**64 - 1)
        for b in samples
    )


_LOW_HALF = _low_half_is_xxh3()


def xxh3_from_identity(identity: str, nbytes: int) -> int | None:
    """The XXH3-64 of bytes whose `identity` is known, where it can be read
    off it (more than 240 bytes), so that it is not computed again; else None."""
    return int(identity[16:], 16) if _LOW_HALF and nbytes > 240 else None


def digest(data: bytes | memoryview) -> str:
    """The checksum of a JSON file's bytes as written: `xxh3:<16 hex digits>`."""
    return f"{DIGEST}:{xxhash.xxh3_64_intdigest(data):016x}"


# Held one per byte by numpy: integers by value, floats by their 4-bit pattern.
_SUB_BYTE_INTS = ("int4", "uint4", "int2", "uint2")
_SUB_BYTE_FLOATS = ("float4_e2m1fn",)


def host_sum32(x: np.ndarray) -> int:
    """`sum32` of a host array (typed PRNG keys: of their key data)."""
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
    digits = 18 if kind == NAME else 10  # 64 bits: 16 hexadecimal digits
    return (
        f"Leaf `{record.path}` ({record.name}): {kind} recorded at save "
        f"{recorded:#0{digits}x}, computed from the data now {found:#0{digits}x}."
    )


def damaged(directory: Any, problems: Sequence[str]) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The data of {len(problems)} leaf(s) of the checkpoint in {directory} "
        "changed after it was saved (a flipped bit on disk, or a damaged copy):\n"
        + bullet_list(problems)
        + "\n"
        + FALL_BACK
    )
