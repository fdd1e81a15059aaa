"""Shard packs' indexes, read: each index parsed and checked against the
sidecar before any array byte is read (the format is `index.py`)."""

import functools
import math
import os
import stat

import msgspec
from etils import epath

from ..._bytes.route import is_remote, read_bounded
from ..._errors import CheckpointDamagedError, SidecarError, permission_denied
from ..._format import schema as _schema
from ..._format import sealed as _sealed
from ..._format.sidecar import (
    SHARDS,
    LeafMetadata,
    Metadata,
    itemsize,
    shard_file,
    shard_index,
    shared_dir,
)
from ..._format.sidecar_read import SHARD_NAME, check_version
from ..._tree.walk import parse_dtype
from .index import MAX_INDEX_BYTES, Chunk, ShardPack, block_size


def read_all(directory: epath.Path, saved: Metadata) -> dict[str, list[Chunk]]:
    """Reads and checks every process's index; returns each sharded leaf's chunks."""
    records = {n: r for n, r in saved.leaves.items() if r.data == SHARDS}
    chunks: dict[str, list[Chunk]] = {name: [] for name in records}
    token = token_of(saved)
    for process in range(saved.shard_files):
        try:
            pack = _read_one(directory, token, process)
        except CheckpointDamagedError as e:
            paths = [f"`{r.path}`" for r in records.values()]
            more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
            raise CheckpointDamagedError(
                f"{e} Without it, the sharded leaves {', '.join(paths[:3])}{more} "
                "cannot be restored."
            ) from None
        index = shard_index(token, process)
        if pack.shared and saved.saved_as is None:
            raise _damaged(
                directory,
                index,
                "it lists shared shard packs, which only the steps of a manager "
                "have, but the sidecar records no manager's step",
            )
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


def _read_one(directory: epath.Path, token: str, process: int) -> ShardPack:
    name = shard_index(token, process)

    def bad(what: str) -> CheckpointDamagedError:
        return _damaged(directory, name, what)

    index = _decoded(directory / name, bad)
    if index.token != token or index.process != process:
        raise bad(
            f"it names the save {index.token!r} and process {index.process!r}, "
            f"expected {token!r} and {process}"
        )
    if index.file != shard_file(token, process):
        raise bad(f"it names the file {index.file[:80]!r}")
    files = _files(index, bad)
    names = list(files)
    chunks = [
        _chunk(index, leaf, row, process, names, bad)
        for leaf, rows in index.chunks.items()
        for row in rows
    ]
    return ShardPack(
        process, index.file, index.nbytes, tuple(chunks), files, index.shared
    )


def _decoded(path: epath.Path, bad) -> _schema.ShardIndex:
    """The shard index at `path`, its seal, version and schema checked."""
    text = _read_bounded(path)
    if not _sealed.check(text, lambda what: bad(f"it {what}")):
        raise bad("it records no checksum on its last line: it was edited")
    try:
        head = msgspec.json.decode(text, type=_schema.Versioned)
        check_version(head, f"The shard index {path}", bad)
        return msgspec.json.decode(text, type=_schema.ShardIndex)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise bad(f"it is not a shard index as orbax_eqx writes it ({e})") from None
    except SidecarError as e:
        raise bad(str(e)) from None


def _chunk(index, leaf: str, row, process: int, names: list[str], bad) -> Chunk:
    """One row of the index as a `Chunk`, its box's ranks and file checked."""
    if len(row.start) != len(row.stop):
        raise bad(f"a chunk of `{leaf}` has a box of two ranks")
    at = 0 if index.files is msgspec.UNSET else row.file
    if at is msgspec.UNSET or at >= len(names) or at != (row.file or 0):
        raise bad(
            f"a chunk of `{leaf}` names file {_said(row.file)} where the "
            f"index lists {len(index.files or ())}"
        )
    return Chunk(
        leaf,
        process,
        tuple(row.start),
        tuple(row.stop),
        row.offset,
        row.nbytes,
        row.block,
        tuple(int(x, 16) for x in row.xxh3s),
        names[at],
        index.shared,
        row.xxh3_128 or None,
    )


def _files(index: _schema.ShardIndex, bad) -> dict[str, int]:
    """`{shard pack: size}` of the files the index's chunks are in: its own,
    or with dedup, those it lists, whose names must be shard packs'."""
    if index.files is msgspec.UNSET:
        return {index.file: index.nbytes}
    files: dict[str, int] = {}
    for i, record in enumerate(index.files):
        if not SHARD_NAME.fullmatch(record.file):
            # As pack names: a name read from a file is never taken as a path.
            raise bad(f"file {i} is {record.file[:80]!r}, not a shard pack")
        if record.file in files:
            raise bad(f"it lists the file {record.file} twice")
        files[record.file] = record.nbytes
    return files


def _said(file) -> str:
    return "none" if file is msgspec.UNSET else str(file)


def chunk_path(directory: epath.Path, chunk: Chunk) -> epath.Path:
    """Where the shard pack holding `chunk` of the checkpoint in `directory` is."""
    if chunk.shared:
        return shared_dir(directory) / chunk.file
    return epath.Path(directory) / chunk.file


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


def _check_file(directory, pack: ShardPack, records) -> None:
    """The shard packs must be there, with the sizes its index records (a
    shared one that is gone is named by `read.check_shared`, with its leaves)."""
    where = shared_dir(directory) if pack.shared else epath.Path(directory)
    for file, nbytes in pack.files.items():
        path = where / file
        if is_remote(path):
            return  # checked by the reads
        try:
            st = os.stat(os.fspath(path))
        except FileNotFoundError:
            if pack.shared:
                continue
            found = "it is missing"
        except PermissionError:
            raise permission_denied(path) from None
        else:
            if not stat.S_ISREG(st.st_mode):
                found = "it is not a regular file"
            elif st.st_size != nbytes:
                found = f"it has {st.st_size} bytes where its index records {nbytes}"
            else:
                continue
        held = [c for c in pack.chunks if c.file == file]
        _file_damaged(directory, file, found, held, records)


def _file_damaged(directory, file: str, found: str, chunks, records):
    names = sorted({f"`{records[c.name].path}`" for c in chunks})
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    raise CheckpointDamagedError(
        f"The shard pack {file} of the checkpoint in {directory} is damaged: "
        f"{found} (a copy cut short, or a file deleted). It holds chunks of the "
        f"sharded leaves {', '.join(names[:3])}{more}. Restore an earlier step "
        "(`oeqx.restore_latest` falls back past damaged steps); `python -m "
        "orbax_eqx verify PATH` checks every leaf."
    )


def _check_chunk(directory, pack: ShardPack, record: LeafMetadata, chunk: Chunk):
    def bad(what: str) -> CheckpointDamagedError:
        return _damaged(
            directory,
            pack.file.removesuffix(".bin") + ".json",
            f"leaf `{record.path}` ({record.name}) chunk {chunk.box()} {what}",
        )

    shape = record.shape or ()
    if len(chunk.start) != len(shape) or any(
        not 0 <= a < b <= n
        for a, b, n in zip(chunk.start, chunk.stop, shape, strict=True)
    ):
        raise bad(f"lies outside the array, of shape {tuple(shape)}")
    expected = math.prod(chunk.shape) * _item_bytes(record.dtype)
    if chunk.nbytes != expected:
        raise bad(f"has {chunk.nbytes} bytes where its box needs {expected}")
    if chunk.offset + chunk.nbytes > pack.files[chunk.file]:
        raise bad(
            f"ends at byte {chunk.offset + chunk.nbytes} of {chunk.file}, which "
            f"holds {pack.files[chunk.file]}"
        )
    kind = "XXH3-64s"
    if chunk.block != block_size(chunk.nbytes):
        raise bad(
            f"has {kind} of {chunk.block}-byte blocks where a chunk of "
            f"{chunk.nbytes} bytes has {block_size(chunk.nbytes)}-byte ones"
        )
    if len(chunk.sums) != -(-chunk.nbytes // chunk.block):
        raise bad(f"has {len(chunk.sums)} {kind} for {chunk.nbytes} bytes")


@functools.cache
def _item_bytes(dtype: str) -> int:
    return itemsize(parse_dtype(dtype))


def _check_tiling(directory, saved: Metadata, record: LeafMetadata, chunks) -> None:
    """The chunks of one array form a grid that covers it once: per dimension,
    their intervals split `[0, n)` without gaps or overlaps, and every box of
    the grid is there exactly once (sharded arrays are always such grids)."""
    shape = tuple(record.shape or ())

    def bad(what: str) -> CheckpointDamagedError:
        token = token_of(saved)
        if saved.shard_files == 1:
            files = shard_index(token, 0)
        else:
            files = (
                f"{shard_index(token, 0)} ... "
                f"{shard_index(token, saved.shard_files - 1)} "
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


def token_of(saved: Metadata) -> str:
    """The save's token, which names its shard packs (every sidecar that lists
    shard packs has one: `sidecar_read` checks)."""
    if not saved.token:
        raise CheckpointDamagedError(
            f"The sidecar of the checkpoint in {saved.directory} lists shard packs "
            "but records no token to name them by: it is damaged. Restore an "
            "earlier step."
        )
    return saved.token


def _damaged(directory, file: str, what: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The shard index {file} of the checkpoint in {directory} is damaged: "
        f"{what}. Restore an earlier step (`oeqx.restore_latest` falls back past "
        "damaged steps); `python -m orbax_eqx verify PATH` checks every leaf."
    )
