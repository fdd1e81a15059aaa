"""The index of a shard pack: which chunk of which array lies where in its file."""

import dataclasses
import json
from collections.abc import Iterable

import numpy as np
import xxhash

from ..._format.sealed import seal
from ..._format.sidecar import FORMAT_VERSION, shard_file

INDEX_FORMAT = "orbax_eqx.shards"
MIN_BLOCK = 4096  # a chunk up to this size is one block
MAX_BLOCK = 1 << 20
BLOCKS = 64  # blocks per chunk, about, between those sizes
# An index holds a few numbers per chunk: a million chunks fit many times.
MAX_INDEX_BYTES = 256 << 20


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
    sums: tuple[int, ...]  # the XXH3-64 of each `block` bytes
    file: str = ""  # the shard pack holding it (its process's, if not named)
    shared: bool = False  # that pack is in the shared directory beside the steps
    identity: str | None = None  # with dedup: the XXH3-128 of its bytes

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
    """One process's shard pack: its file, size and chunks, and `files`, the
    size of each shard pack its chunks are in (with dedup, other saves' too)."""

    process: int
    file: str
    nbytes: int
    chunks: tuple[Chunk, ...]
    files: dict[str, int] = dataclasses.field(default_factory=dict)
    shared: bool = False  # `files` are in the shared directory


def block_size(nbytes: int) -> int:
    """Bytes per checksum of a chunk of `nbytes` bytes (see the module's doc)."""
    if nbytes <= MIN_BLOCK:
        return max(nbytes, 1)
    per = -(-nbytes // BLOCKS)
    return min(MAX_BLOCK, -(-per // MIN_BLOCK) * MIN_BLOCK)


def block_sums(data, block: int) -> list[int]:
    """The XXH3-64 of each `block` bytes of `data` (an array's bytes in C order)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    xxh3 = xxhash.xxh3_64_intdigest
    return [xxh3(data[at : at + block]) for at in range(0, len(data), block)]


def check_blocks(chunk: Chunk, a: int, data) -> list[tuple[int, int, int]]:
    """Checks bytes `[a, a + len(data))` of `chunk`, which must be whole blocks
    (the last may end at the chunk's end); returns `(block, recorded, found)`
    of each block that differs."""
    view = memoryview(data).cast("B")
    bad = []
    xxh3 = xxhash.xxh3_64_intdigest
    for at in range(0, len(view), chunk.block):
        i = (a + at) // chunk.block
        found = xxh3(view[at : at + chunk.block])
        if found != chunk.sums[i]:
            bad.append((i, chunk.sums[i], found))
    return bad


def widen(chunk: Chunk, first: int, last: int) -> tuple[int, int]:
    """`[first, last)` of a chunk's bytes widened to whole blocks of it."""
    block = chunk.block
    return first // block * block, min(-(-last // block) * block, chunk.nbytes)


def to_bytes(
    token: str,
    process: int,
    nbytes: int,
    chunks: Iterable[Chunk],
    files: dict[str, int] | None = None,
) -> bytes:
    """The index's bytes: one line per array (readable, and diffs well), sealed.
    `files` (`{shard pack: size}`, with dedup): the shared shard packs its
    chunks are in, each chunk naming its own."""
    by_name: dict[str, list] = {}
    at = {name: i for i, name in enumerate(files or ())}
    for c in chunks:
        row = [list(c.start), list(c.stop), c.offset, c.nbytes, c.block]
        row.append([f"{x:016x}" for x in c.sums])
        if files is not None:
            row += [at[c.file], c.identity]
        by_name.setdefault(c.name, []).append(row)
    head: dict = {
        "format": INDEX_FORMAT,
        "format_version": FORMAT_VERSION,
        "token": token,
        "process": process,
        "file": shard_file(token, process),
        "nbytes": nbytes,
    }
    if files is not None:
        head["shared"] = True
        head["files"] = [{"file": f, "nbytes": n} for f, n in files.items()]
    rows = ",\n".join(
        f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v)}"
        for k, v in by_name.items()
    )
    text = json.dumps(head)[:-1] + ', "chunks": {\n' + rows + "\n },\n"
    return seal(text.encode())
