"""The index of a shard pack: which chunk of which array lies where in its file.

Every process of a save writes one shard pack (`orbax_eqx~shards.<token>.<p>.bin`)
holding the distinct shards it owns of every sharded array, and one index
(`orbax_eqx~shards.<token>.<p>.json`) beside it:

```
{"format": "orbax_eqx.shards", "format_version": 2, "token": "9f2c41d07a3be865",
 "process": 1, "file": "orbax_eqx~shards.9f2c41d07a3be865.1.bin",
 "nbytes": 16384,
 "chunks": {"blocks.0.mlp.weight": [[[64, 0], [128, 64], 0, 16384, 4096,
                                     [2351671402, 11423, 90210, 3141592]]]}}
```

A chunk is `[start, stop, offset, nbytes, block, crc32s]`: its box in the
array's global coordinates (`start` inclusive, `stop` exclusive, one entry
per dimension), the byte range of the file holding the box's elements in C
order (layout as in pack files: native byte order, typed PRNG keys as their
key data), and the CRC-32 of each `block` bytes of that range, so that a read
of part of a chunk is checked too, widened to whole blocks of its own chunk
only. The block is chosen per chunk (`block_size`): the whole chunk up to
4 KiB, else about a 64th of it in multiples of 4 KiB, at most 1 MiB, so that
a read of an eighth of a chunk or more reads at most a quarter more to check.

Each block's CRC-32 starts from a value (`seed`) computed from what says
where its bytes belong: the save's token, the process, the leaf name, the
stored element type (`leaf_seed`), then the box, the offset, the length and
the block size (`binding`), and the block's number. An index whose chunks
swap boxes, point two chunks at one byte range, or was copied from another
save with its token edited, makes every moved chunk fail its check, in
`restore` and in `verify` alike (one function checks for both,
`check_blocks`).

Version 1 (sidecar formats 4 and below) has one `"crc_block": 1048576` for the
whole index, chunks `[start, stop, offset, nbytes, crc32s]` and CRC-32s that
start from 0: it is still read, never written. A format-5 sidecar's save
wrote version 2; an index of version 1 there was put in by hand.

Reading validates everything against the sidecar before any array byte is
read: every chunk lies inside its array and its file, has the bytes its box
needs, and the chunks of each array, over all processes, tile it exactly.
File names are derived from the token and the process, never read from the
index.
"""

import dataclasses
import functools
import json
import math
import os
import stat
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

from ..._bytes.paths import is_remote
from ..._bytes.route import read_bounded
from ..._errors import CheckpointDamagedError, permission_denied
from ..._format.sidecar import (
    SHARDS,
    LeafMetadata,
    Metadata,
    itemsize,
    shard_file,
    shard_index,
)
from ..._tree.walk import is_key_dtype, key_data_struct, parse_dtype

INDEX_FORMAT = "orbax_eqx.shards"
INDEX_VERSION = 2
OLD_BLOCK = 1 << 20  # bytes per CRC-32 of every chunk, version 1
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
    block: int  # bytes per CRC-32
    crcs: tuple[int, ...]  # CRC-32 of each `block` bytes
    # The CRC-32s' start value, binding them to where the bytes belong (see
    # `binding`); None for version 1 indexes, whose CRC-32s start from 0.
    seed: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    def box(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop)) + "]"


@dataclasses.dataclass(frozen=True)
class ShardPack:
    """One process's shard pack: its file, size and chunks."""

    process: int
    file: str
    nbytes: int
    version: int
    chunks: tuple[Chunk, ...]


def block_size(nbytes: int) -> int:
    """Bytes per CRC-32 of a chunk of `nbytes` bytes (see the module's doc)."""
    if nbytes <= MIN_BLOCK:
        return max(nbytes, 1)
    per = -(-nbytes // BLOCKS)
    return min(MAX_BLOCK, -(-per // MIN_BLOCK) * MIN_BLOCK)


def leaf_seed(token: str, process: int, name: str, stored: str) -> int:
    """The part of a chunk's `binding` shared by a leaf's chunks in one index:
    a CRC-32 of the save's token, the process, the leaf name and `stored`
    (`stored_text` of its element type)."""
    text = json.dumps([token, process, name, stored], ensure_ascii=False)
    return zlib.crc32(text.encode())


def binding(
    seed: int,
    start: tuple[int, ...],
    stop: tuple[int, ...],
    offset: int,
    nbytes: int,
    block: int,
) -> int:
    """The seed of a chunk's CRC-32s: the CRC-32 of what says where it belongs
    (its box, offset, length and block size), continuing from its leaf's
    `leaf_seed`. `start` and `stop` are tuples of Python ints."""
    return zlib.crc32(f"{start}{stop}{offset},{nbytes},{block}".encode(), seed)


def stored_text(elem: np.dtype, tail: Sequence[int]) -> str:
    """The element type of stored bytes as bound into CRC-32s: its numpy name,
    and for typed PRNG keys the key data's own axes (`uint32[2]`)."""
    return np.dtype(elem).name + (str(list(tail)) if len(tail) else "")


@functools.cache
def _stored_of(dtype: str) -> str:
    saved = parse_dtype(dtype)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        return stored_text(np.dtype(data.dtype), tuple(data.shape))
    return stored_text(np.dtype(saved), ())


def _block_seed(seed: int | None, i: int) -> int:
    return 0 if seed is None else zlib.crc32(i.to_bytes(8, "little"), seed)


def block_crcs(data, block: int, seed: int | None) -> list[int]:
    """CRC-32 of each `block` bytes of `data` (an array's bytes in C order),
    block `i` started from its seed (`seed`: the chunk's `binding`)."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return [
        zlib.crc32(data[at : at + block], _block_seed(seed, at // block))
        for at in range(0, len(data), block)
    ]


def check_blocks(chunk: Chunk, a: int, data) -> list[tuple[int, int, int]]:
    """Checks bytes `[a, a + len(data))` of `chunk`, which must be whole blocks
    (the last may end at the chunk's end); returns `(block, recorded, found)`
    of each block that differs."""
    view = memoryview(data).cast("B")
    bad = []
    for at in range(0, len(view), chunk.block):
        i = (a + at) // chunk.block
        found = zlib.crc32(view[at : at + chunk.block], _block_seed(chunk.seed, i))
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
        row = [list(c.start), list(c.stop), c.offset, c.nbytes, c.block, list(c.crcs)]
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


def read_all(directory: epath.Path, saved: Metadata) -> dict[str, list[Chunk]]:
    """Reads and checks every process's index; returns each sharded leaf's chunks.

    Raises `CheckpointDamagedError` naming the file and the leaf for a missing
    or unreadable index, a chunk outside its array or its file, a chunk whose
    size is not its box's, and chunks that do not tile their array. The
    chunks of a version-2 index come with their `seed`, so that reading them
    checks where they belong too.
    """
    records = {n: r for n, r in saved.leaves.items() if r.data == SHARDS}
    chunks: dict[str, list[Chunk]] = {name: [] for name in records}
    # Sidecar formats 5 on save version 2 (the type handler's groups, whose
    # own index has a version of its own, may hold either).
    versions = (INDEX_VERSION,) if saved.format_version >= 5 else (1, INDEX_VERSION)
    # The element type the sidecar records is bound into each chunk's seed.
    stored = {name: _stored_of(r.dtype) for name, r in records.items()}
    for process in range(saved.shard_files):
        try:
            pack = _read_one(directory, saved.token, process, versions, stored)
        except CheckpointDamagedError as e:
            paths = [f"`{r.path}`" for r in records.values()]
            more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
            raise CheckpointDamagedError(
                f"{e} Without it, the sharded leaves {', '.join(paths[:3])}{more} "
                "cannot be restored."
            ) from None
        index = shard_index(saved.token, process)
        for chunk in pack.chunks:
            record = records.get(chunk.name)
            if record is None:
                raise _damaged(
                    directory,
                    index,
                    f"it has chunks of `{chunk.name}`, which "
                    "the sidecar does not list as an array in shard packs",
                )
            _check_chunk(directory, pack, record, chunk)
            chunks[chunk.name].append(chunk)
        _check_file(directory, pack, records)
    for name, record in records.items():
        _check_tiling(directory, saved, record, chunks[name])
    return chunks


def _read_one(
    directory: epath.Path, token: str, process: int, versions, stored
) -> ShardPack:
    name = shard_index(token, process)
    text = _read_bounded(directory / name)
    try:
        content = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _damaged(directory, name, f"it is not valid JSON ({e})") from None
    return _parse(directory, name, content, token, process, versions, stored)


def _read_bounded(path: epath.Path) -> bytes:
    """The file's bytes; refuses what is not a regular file, and huge files."""
    try:
        return read_bounded(
            path,
            MAX_INDEX_BYTES,
            lambda what: _damaged(path.parent, path.name, f"it {what}"),
        )
    except FileNotFoundError:
        raise _damaged(path.parent, path.name, "it is missing") from None
    except PermissionError:
        raise permission_denied(path) from None


def _parse(
    directory, name: str, content: Any, token: str, process: int, versions, stored
) -> ShardPack:
    def bad(what: str) -> CheckpointDamagedError:
        return _damaged(directory, name, what)

    if not isinstance(content, dict) or content.get("format") != INDEX_FORMAT:
        raise bad(f'expected a JSON object with "format": "{INDEX_FORMAT}"')
    version = content.get("format_version")
    if type(version) is not int or version not in versions:
        expected = " or ".join(str(v) for v in versions)
        raise bad(
            f"format_version {version!r} is not {expected}"
            + (
                " (a version-1 index in a checkpoint of sidecar format 5 or later)"
                if version == 1
                else ""
            )
        )
    if content.get("token") != token or content.get("process") != process:
        raise bad(
            f"it names the save {content.get('token')!r} and process "
            f"{content.get('process')!r}, expected {token!r} and {process}"
        )
    if content.get("file") != shard_file(token, process):
        raise bad(f"it names the file {content.get('file')!r}")
    nbytes = content.get("nbytes")
    if not _is_size(nbytes):
        raise bad('"nbytes" must be a size')
    old_block = None
    if version == 1:
        old_block = content.get("crc_block")
        if old_block != OLD_BLOCK:
            raise bad(f'"crc_block" is {old_block!r}, not {OLD_BLOCK}')
    rows = content.get("chunks")
    if not isinstance(rows, dict):
        raise bad('"chunks" must be a JSON object')
    width = 5 if version == 1 else 6
    form = (
        "[start, stop, offset, nbytes, crc32s]"
        if version == 1
        else "[start, stop, offset, nbytes, block, crc32s]"
    )
    chunks = []
    for leaf, leaf_rows in rows.items():
        if not isinstance(leaf_rows, list):
            raise bad(f"the chunks of `{leaf}` are not a list")
        seed = None  # version 1, or a leaf the sidecar lacks (refused later)
        if version >= 2 and leaf in stored:
            seed = leaf_seed(token, process, leaf, stored[leaf])
        for row in leaf_rows:
            if not (
                isinstance(row, list)
                and len(row) == width
                and _is_sizes(row[0])
                and _is_sizes(row[1])
                and len(row[0]) == len(row[1])
                and _is_size(row[2])
                and _is_size(row[3])
                and (version == 1 or (_is_size(row[4]) and row[4] > 0))
                and isinstance(row[-1], list)
                and all(_is_size(c) and c < 2**32 for c in row[-1])
            ):
                raise bad(f"a chunk of `{leaf}` is not {form}")
            start, stop, offset, size = tuple(row[0]), tuple(row[1]), row[2], row[3]
            block = old_block or row[4]
            chunks.append(
                Chunk(
                    leaf,
                    process,
                    start,
                    stop,
                    offset,
                    size,
                    block,
                    tuple(row[-1]),
                    None
                    if seed is None
                    else binding(seed, start, stop, offset, size, block),
                )
            )
    return ShardPack(
        process, shard_file(token, process), nbytes, version, tuple(chunks)
    )


def _check_file(directory, pack: ShardPack, records) -> None:
    """The shard pack must be there, with the size its index records."""
    path = epath.Path(directory) / pack.file
    if is_remote(path):
        return  # checked by the reads
    try:
        st = os.stat(os.fspath(path))
    except FileNotFoundError:
        found = "it is missing"
    except PermissionError:
        raise permission_denied(path) from None
    else:
        if not stat.S_ISREG(st.st_mode):
            found = "it is not a regular file"
        elif st.st_size != pack.nbytes:
            found = f"it has {st.st_size} bytes where its index records {pack.nbytes}"
        else:
            return
    names = sorted({f"`{records[c.name].path}`" for c in pack.chunks})
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    raise CheckpointDamagedError(
        f"The shard pack {pack.file} of the checkpoint in {directory} is damaged: "
        f"{found} (a copy cut short, or a file deleted). It holds chunks of the "
        f"sharded leaves {', '.join(names[:3])}{more}. Restore an earlier step "
        "(`oeqx.restore_latest` falls back past damaged steps); `python -m "
        "orbax_eqx verify PATH` checks every leaf."
    )


def _is_size(x: Any) -> bool:
    return type(x) is int and x >= 0


def _is_sizes(x: Any) -> bool:
    return isinstance(x, list) and all(_is_size(v) for v in x)


def _check_chunk(directory, pack: ShardPack, record: LeafMetadata, chunk: Chunk):
    def bad(what: str) -> CheckpointDamagedError:
        return _damaged(
            directory,
            pack.file.removesuffix(".bin") + ".json",
            f"leaf `{record.path}` ({record.name}) chunk {chunk.box()} {what}",
        )

    shape = record.shape or ()
    if len(chunk.start) != len(shape) or any(
        not 0 <= a < b <= n for a, b, n in zip(chunk.start, chunk.stop, shape)
    ):
        raise bad(f"lies outside the array, of shape {tuple(shape)}")
    expected = math.prod(chunk.shape) * _item_bytes(record.dtype)
    if chunk.nbytes != expected:
        raise bad(f"has {chunk.nbytes} bytes where its box needs {expected}")
    if chunk.offset + chunk.nbytes > pack.nbytes:
        raise bad(
            f"ends at byte {chunk.offset + chunk.nbytes} of {pack.file}, which "
            f"holds {pack.nbytes}"
        )
    if pack.version >= 2 and chunk.block != block_size(chunk.nbytes):
        raise bad(
            f"has CRC-32s of {chunk.block}-byte blocks where a chunk of "
            f"{chunk.nbytes} bytes has {block_size(chunk.nbytes)}-byte ones"
        )
    if len(chunk.crcs) != -(-chunk.nbytes // chunk.block):
        raise bad(f"has {len(chunk.crcs)} CRC-32s for {chunk.nbytes} bytes")


@functools.cache
def _item_bytes(dtype: str) -> int:
    return itemsize(parse_dtype(dtype))


def _check_tiling(directory, saved: Metadata, record: LeafMetadata, chunks) -> None:
    """The chunks of one array form a grid that covers it once: per dimension,
    their intervals split `[0, n)` without gaps or overlaps, and every box of
    the grid is there exactly once (sharded arrays are always such grids)."""
    shape = tuple(record.shape or ())

    def bad(what: str) -> CheckpointDamagedError:
        if saved.shard_files == 1:
            files = shard_index(saved.token, 0)
        else:
            files = (
                f"{shard_index(saved.token, 0)} ... "
                f"{shard_index(saved.token, saved.shard_files - 1)} "
                f"(together; {saved.shard_files} processes)"
            )
        return _damaged(
            directory, files, f"leaf `{record.path}` ({record.name}) {what}"
        )

    if not chunks:
        raise bad(
            "has no chunks in any shard pack (a process's files are missing "
            "or were replaced)"
        )
    cuts = []
    for d, n in enumerate(shape):
        spans = sorted({(c.start[d], c.stop[d]) for c in chunks})
        at = 0
        for a, b in spans:
            if a != at:
                gap = "overlap" if a < at else "gap"
                raise bad(f"has chunks that {gap} along dimension {d} at {min(a, at)}")
            at = b
        if at != n:
            raise bad(f"has chunks covering dimension {d} up to {at} of {n}")
        cuts.append(len(spans))
    boxes = {(c.start, c.stop) for c in chunks}
    if len(boxes) != len(chunks):
        raise bad("has the same box stored twice")
    if len(boxes) != math.prod(cuts):
        raise bad(f"has {len(boxes)} chunks where its grid needs {math.prod(cuts)}")


def _damaged(directory, file: str, what: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The shard index {file} of the checkpoint in {directory} is damaged: "
        f"{what}. Restore an earlier step (`oeqx.restore_latest` falls back past "
        "damaged steps); `python -m orbax_eqx verify PATH` checks every leaf."
    )
