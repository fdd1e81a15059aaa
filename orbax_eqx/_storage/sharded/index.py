"""The index of a shard pack: which chunk of which array lies where in its file.

Every process of a save writes one shard pack (`orbax_eqx~shards.<token>.<p>.bin`)
holding the distinct shards it owns of every sharded array, and one index
(`orbax_eqx~shards.<token>.<p>.json`) beside it:

```
{"format": "orbax_eqx.shards", "format_version": 3, "token": "9f2c41d07a3be865",
 "process": 1, "file": "orbax_eqx~shards.9f2c41d07a3be865.1.bin",
 "nbytes": 16384,
 "chunks": {"blocks.0.mlp.weight": [[[64, 0], [128, 64], 0, 16384, 4096,
                                     ["9d3a61c2e8f0b457", ...]]]}}
```

A chunk is `[start, stop, offset, nbytes, block, sums]`: its box in the
array's global coordinates (`start` inclusive, `stop` exclusive, one entry
per dimension), the byte range of the file holding the box's elements in C
order (layout as in pack files: native byte order, typed PRNG keys as their
key data), and the XXH3-64 (16 lower-case hexadecimal digits) of each
`block` bytes of that range, so that a read of part of a chunk is checked
too, widened to whole blocks of its own chunk only. The block is chosen per
chunk (`block_size`): the whole chunk up to 4 KiB, else about a 64th of it
in multiples of 4 KiB, at most 1 MiB, so that a read of an eighth of a chunk
or more reads at most a quarter more to check.

Each block's checksum is seeded with a value computed from what says where
its bytes belong: the save's token, the process, the leaf name, the stored
element type (`leaf_seed`), then the box, the offset, the length and the
block size (`binding`), and the block's number. An index whose chunks swap
boxes, point two chunks at one byte range, or was copied from another save
with its token edited, makes every moved chunk fail its check, in `restore`
and in `verify` alike (one function checks for both, `check_blocks`).

Earlier versions are read, never written. Version 2 (sidecar format 5) is
the same with CRC-32s (integers) chained from those seeds; version 1
(sidecar formats 4 and below) has one `"crc_block": 1048576` for the whole
index, chunks `[start, stop, offset, nbytes, crc32s]` and CRC-32s that start
from 0. Each sidecar format's save wrote one version (`versions_for`): an
index of another was put in by hand. XXH3-64 sums at memory speed, about
six times zlib's CRC-32 here (~20 GB/s against ~3.4 on one thread:
`benchmarks/checksums.py`).

Reading (`index_read`) validates everything against the sidecar before any
array byte is read.
"""

import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence

import numpy as np

from ..._format.checksum import CRC32, XXH3, seeded
from ..._format.sidecar import (
    shard_file,
)
from ..._tree.walk import is_key_dtype, key_data_struct, parse_dtype

INDEX_FORMAT = "orbax_eqx.shards"
INDEX_VERSION = 3
OLD_BLOCK = 1 << 20  # bytes per CRC-32 of every chunk, version 1
MIN_BLOCK = 4096  # a chunk up to this size is one block
MAX_BLOCK = 1 << 20
BLOCKS = 64  # blocks per chunk, about, between those sizes


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One box of one array, as stored in one shard pack."""

    name: str  # the leaf name
    process: int  # whose shard pack holds it
    start: tuple[int, ...]
    stop: tuple[int, ...]
    offset: int
    nbytes: int
    block: int  # bytes per checksum
    crcs: tuple[int, ...]  # the checksum of each `block` bytes
    # The checksums' seed, binding them to where the bytes belong (see
    # `binding`); None for version 1 indexes, whose CRC-32s start from 0.
    seed: int | None = None
    algorithm: str = CRC32  # of `crcs`: `algorithm_of` the index's version

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    def box(self) -> str:
        return (
            "["
            + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop, strict=True))
            + "]"
        )


@dataclasses.dataclass(frozen=True)
class ShardPack:
    """One process's shard pack: its file, size and chunks."""

    process: int
    file: str
    nbytes: int
    version: int
    chunks: tuple[Chunk, ...]


def algorithm_of(version: int) -> str:
    """The checksum of an index of `version`: XXH3-64 from version 3 on."""
    return XXH3 if version >= 3 else CRC32


def versions_for(format_version: int) -> tuple[int, ...]:
    """The index versions a save of sidecar format `format_version` wrote."""
    if format_version >= 6:
        return (3,)
    if format_version == 5:
        return (2,)
    return (1, 2)


def block_size(nbytes: int) -> int:
    """Bytes per CRC-32 of a chunk of `nbytes` bytes (see the module's doc)."""
    if nbytes <= MIN_BLOCK:
        return max(nbytes, 1)
    per = -(-nbytes // BLOCKS)
    return min(MAX_BLOCK, -(-per // MIN_BLOCK) * MIN_BLOCK)


def leaf_seed(token: str, process: int, name: str, stored: str, algorithm: str) -> int:
    """The part of a chunk's `binding` shared by a leaf's chunks in one index:
    the checksum (`algorithm`) of the save's token, the process, the leaf name
    and `stored` (`stored_text` of its element type)."""
    text = json.dumps([token, process, name, stored], ensure_ascii=False)
    return seeded(text.encode(), 0, algorithm)


def binding(
    seed: int,
    start: tuple[int, ...],
    stop: tuple[int, ...],
    offset: int,
    nbytes: int,
    block: int,
    algorithm: str,
) -> int:
    """The seed of a chunk's checksums: the checksum (`algorithm`) of what
    says where it belongs (its box, offset, length and block size), seeded
    with its leaf's `leaf_seed`. `start` and `stop` are tuples of Python
    ints."""
    text = f"{start}{stop}{offset},{nbytes},{block}".encode()
    return seeded(text, seed, algorithm)


def stored_text(elem: np.dtype, tail: Sequence[int]) -> str:
    """The element type of stored bytes as bound into CRC-32s: its numpy name,
    and for typed PRNG keys the key data's own axes (`uint32[2]`)."""
    return np.dtype(elem).name + (str(list(tail)) if len(tail) else "")


@functools.cache
def stored_of(dtype: str) -> str:
    """`stored_text` of a sidecar dtype (typed PRNG keys: of their key data)."""
    saved = parse_dtype(dtype)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        return stored_text(np.dtype(data.dtype), tuple(data.shape))
    return stored_text(np.dtype(saved), ())


def _block_seed(seed: int | None, i: int, algorithm: str) -> int:
    if seed is None:
        return 0
    return seeded(i.to_bytes(8, "little"), seed, algorithm)


def block_crcs(data, block: int, seed: int | None, algorithm: str) -> list[int]:
    """The checksum (`algorithm`) of each `block` bytes of `data` (an array's
    bytes in C order), block `i` seeded from `seed` (the chunk's `binding`)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return [
        seeded(
            data[at : at + block], _block_seed(seed, at // block, algorithm), algorithm
        )
        for at in range(0, len(data), block)
    ]


def check_blocks(chunk: Chunk, a: int, data) -> list[tuple[int, int, int]]:
    """Checks bytes `[a, a + len(data))` of `chunk`, which must be whole blocks
    (the last may end at the chunk's end); returns `(block, recorded, found)`
    of each block that differs."""
    view = memoryview(data).cast("B")
    bad = []
    algorithm = chunk.algorithm
    for at in range(0, len(view), chunk.block):
        i = (a + at) // chunk.block
        seed = _block_seed(chunk.seed, i, algorithm)
        found = seeded(view[at : at + chunk.block], seed, algorithm)
        if found != chunk.crcs[i]:
            bad.append((i, chunk.crcs[i], found))
    return bad


def widen(chunk: Chunk, first: int, last: int) -> tuple[int, int]:
    """`[first, last)` of a chunk's bytes widened to whole blocks of it."""
    block = chunk.block
    return first // block * block, min(-(-last // block) * block, chunk.nbytes)


def to_json(token: str, process: int, nbytes: int, chunks: Iterable[Chunk]) -> str:
    by_name: dict[str, list] = {}
    for c in chunks:
        sums: list = list(c.crcs)
        if c.algorithm == XXH3:
            sums = [f"{x:016x}" for x in sums]
        row = [list(c.start), list(c.stop), c.offset, c.nbytes, c.block, sums]
        by_name.setdefault(c.name, []).append(row)
    content = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "token": token,
        "process": process,
        "file": shard_file(token, process),
        "nbytes": nbytes,
        "chunks": by_name,
    }
    # One line per array: readable, and diffs well.
    rows = ",\n".join(
        f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v)}"
        for k, v in by_name.items()
    )
    head = json.dumps({k: v for k, v in content.items() if k != "chunks"})
    return head[:-1] + ', "chunks": {\n' + rows + "\n}}\n"
