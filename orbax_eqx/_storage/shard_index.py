"""The index of a shard pack: which chunk of which array lies where in its file.

Every process of a save writes one shard pack (`orbax_eqx~shards.<token>.<p>.bin`)
holding the distinct shards it owns of every sharded array, and one index
(`orbax_eqx~shards.<token>.<p>.json`) beside it:

```
{"format": "orbax_eqx.shards", "format_version": 1, "token": "9f2c41d07a3be865",
 "process": 1, "file": "orbax_eqx~shards.9f2c41d07a3be865.1.bin",
 "nbytes": 1048640, "crc_block": 1048576,
 "chunks": {"blocks.0.mlp.weight": [[[64, 0], [128, 64], 0, 16384, [2351671402]]]}}
```

A chunk is `[start, stop, offset, nbytes, crc32s]`: its box in the array's
global coordinates (`start` inclusive, `stop` exclusive, one entry per
dimension), the byte range of the file holding the box's elements in C order
(layout as in pack files: native byte order, typed PRNG keys as their key
data), and the CRC-32 of each `crc_block` bytes of that range, so that a read
of part of a chunk is checked too (it is widened to whole blocks).

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
from collections.abc import Iterable
from typing import Any

from etils import epath

from .._bytes.store import read_bounded
from .._errors import CheckpointDamagedError, permission_denied
from .._format.sidecar import (
    SHARDS,
    LeafMetadata,
    Metadata,
    itemsize,
    shard_file,
    shard_index,
)
from .._tree.walk import parse_dtype

INDEX_FORMAT = "orbax_eqx.shards"
INDEX_VERSION = 1
CRC_BLOCK = 1 << 20  # bytes per CRC-32 of a chunk
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
    crcs: tuple[int, ...]  # CRC-32 of each `crc_block` bytes

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
    crc_block: int
    chunks: tuple[Chunk, ...]


def to_json(token: str, process: int, nbytes: int, chunks: Iterable[Chunk]) -> str:
    by_name: dict[str, list] = {}
    for c in chunks:
        row = [list(c.start), list(c.stop), c.offset, c.nbytes, list(c.crcs)]
        by_name.setdefault(c.name, []).append(row)
    content = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "token": token,
        "process": process,
        "file": shard_file(token, process),
        "nbytes": nbytes,
        "crc_block": CRC_BLOCK,
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
    size is not its box's, and chunks that do not tile their array.
    """
    records = {n: r for n, r in saved.leaves.items() if r.data == SHARDS}
    chunks: dict[str, list[Chunk]] = {name: [] for name in records}
    for process in range(saved.shard_files):
        try:
            pack = _read_one(directory, saved.token, process)
        except CheckpointDamagedError as e:
            paths = [f"`{r.path}`" for r in records.values()]
            more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
            raise CheckpointDamagedError(
                f"{e} Without it, the sharded leaves {', '.join(paths[:3])}{more} "
                "cannot be restored."
            ) from None
        for chunk in pack.chunks:
            record = records.get(chunk.name)
            if record is None:
                raise _damaged(
                    directory,
                    pack.file,
                    f"it has chunks of `{chunk.name}`, which "
                    "the sidecar does not list as an array in shard packs",
                )
            _check_chunk(directory, pack, record, chunk)
            chunks[chunk.name].append(chunk)
        _check_file(directory, pack, records)
    for name, record in records.items():
        _check_tiling(directory, saved, record, chunks[name])
    return chunks


def read_pack(directory: epath.Path, token: str, process: int) -> ShardPack:
    """One process's index, checked for form only (see `read_all`)."""
    return _read_one(directory, token, process)


def _read_one(directory: epath.Path, token: str, process: int) -> ShardPack:
    name = shard_index(token, process)
    text = _read_bounded(directory / name)
    try:
        content = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _damaged(directory, name, f"it is not valid JSON ({e})") from None
    return _parse(directory, name, content, token, process)


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


def _parse(directory, name: str, content: Any, token: str, process: int) -> ShardPack:
    def bad(what: str) -> CheckpointDamagedError:
        return _damaged(directory, name, what)

    if not isinstance(content, dict) or content.get("format") != INDEX_FORMAT:
        raise bad(f'expected a JSON object with "format": "{INDEX_FORMAT}"')
    if content.get("format_version") != INDEX_VERSION:
        raise bad(f"format_version {content.get('format_version')!r} is not 1")
    if content.get("token") != token or content.get("process") != process:
        raise bad(
            f"it names the save {content.get('token')!r} and process "
            f"{content.get('process')!r}, expected {token!r} and {process}"
        )
    if content.get("file") != shard_file(token, process):
        raise bad(f"it names the file {content.get('file')!r}")
    nbytes, block = content.get("nbytes"), content.get("crc_block")
    if not (_is_size(nbytes) and _is_size(block) and block > 0):
        raise bad('"nbytes" and "crc_block" must be sizes')
    rows = content.get("chunks")
    if not isinstance(rows, dict):
        raise bad('"chunks" must be a JSON object')
    chunks = []
    for leaf, leaf_rows in rows.items():
        if not isinstance(leaf_rows, list):
            raise bad(f"the chunks of `{leaf}` are not a list")
        for row in leaf_rows:
            if not (
                isinstance(row, list)
                and len(row) == 5
                and _is_sizes(row[0])
                and _is_sizes(row[1])
                and len(row[0]) == len(row[1])
                and _is_size(row[2])
                and _is_size(row[3])
                and isinstance(row[4], list)
                and all(_is_size(c) and c < 2**32 for c in row[4])
            ):
                raise bad(
                    f"a chunk of `{leaf}` is not [start, stop, offset, nbytes, crc32s]"
                )
            chunks.append(
                Chunk(
                    leaf,
                    process,
                    tuple(row[0]),
                    tuple(row[1]),
                    row[2],
                    row[3],
                    tuple(row[4]),
                )
            )
    return ShardPack(process, shard_file(token, process), nbytes, block, tuple(chunks))


def _check_file(directory, pack: ShardPack, records) -> None:
    """The shard pack must be there, with the size its index records."""
    path = epath.Path(directory) / pack.file
    if "://" in os.fspath(path):
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
            pack.file.replace(".bin", ".json"),
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
    if len(chunk.crcs) != -(-chunk.nbytes // pack.crc_block):
        raise bad(f"has {len(chunk.crcs)} CRC-32s for {chunk.nbytes} bytes")
    if pack.crc_block != CRC_BLOCK:
        raise bad(f"has CRC-32s of {pack.crc_block}-byte blocks, not {CRC_BLOCK}")


@functools.cache
def _item_bytes(dtype: str) -> int:
    return itemsize(parse_dtype(dtype))


def _check_tiling(directory, saved: Metadata, record: LeafMetadata, chunks) -> None:
    """The chunks of one array form a grid that covers it once: per dimension,
    their intervals split `[0, n)` without gaps or overlaps, and every box of
    the grid is there exactly once (sharded arrays are always such grids)."""
    shape = tuple(record.shape or ())

    def bad(what: str) -> CheckpointDamagedError:
        files = f"{saved.shard_files} shard index file(s) of the save {saved.token}"
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
