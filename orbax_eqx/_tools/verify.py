"""`verify`: read every array of a checkpoint and check it against its checksum."""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from etils import epath

from .._bytes import damage as _damage
from .._errors import ObjectStoreError, OrbaxEqxError
from .._format.checksum import NAME, Running, host_sum32
from .._format.sidecar import (
    PACKED,
    SHARDS,
    STORED,
    LeafMetadata,
    Metadata,
    shard_file,
)
from .._restore.read import LeafReader, release_memory
from .._storage import ranges as _ranges
from .._storage.sharded.index import check_blocks
from .._storage.sharded.index_read import read_all
from . import plain_items as _plain
from . import step_items as _items
from .plain_read import StoreReader, UnreadableArray
from .typed_items import TypedMetadata, find_item, read

_CHUNK = 64 << 20  # bytes of a packed leaf read at a time


@dataclasses.dataclass(frozen=True)
class DamagedLeaf:
    """A leaf whose data does not match its checksum, or could not be read."""

    name: str
    path: str  # the leaf path, as `jax.tree_util.keystr` prints it
    problem: str


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What `oeqx.verify` found.

    - `directory`: the item directory checked.
    - `checked`: names of the array leaves whose data matched its checksum.
    - `damaged`: a `DamagedLeaf` for each leaf whose data did not match, or
        could not be read at all (a missing or short file).
    - `unchecked`: names of array leaves that record no checksum (saved
        with `checksums=False`, or Orbax-stored arrays no process held whole);
        their data was read, not checked.
    - `nbytes`: bytes of array data read.
    """

    directory: str
    checked: tuple[str, ...]
    damaged: tuple[DamagedLeaf, ...]
    unchecked: tuple[str, ...]
    nbytes: int

    @property
    def ok(self) -> bool:
        """True if no leaf is damaged."""
        return not self.damaged


def verify(
    directory: str | os.PathLike, *, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Reads every array of a checkpoint and checks it against its checksum.

    Every array leaf with data on disk is read, one at a time (a packed leaf,
    and each chunk of a sharded one in the shard packs, in pieces of 64 MiB; an
    Orbax-stored one whole, on the host), so memory stays near the largest
    Orbax-stored leaf. Tied weights are read once. The shard packs' indexes
    are checked too: a chunk outside its array or its file, or chunks that do
    not tile their array, make every sharded leaf damaged.

    **Arguments:**

    - `directory`: a checkpoint: an item directory, or a step with one item;
        one saved through `oeqx.type_handler_registry()` too (its jax arrays
        are checked: Orbax's own handler stored its other leaves); or a plain
        Orbax checkpoint, whose arrays are read back whole (Orbax records no
        checksums: every one is `unchecked` unless it cannot be read).
    - `progress`: called with the bytes of each piece read (for a progress bar).

    **Returns:** a `VerifyReport`; `report.ok` is False if any leaf is damaged.
    Raises if the sidecar itself cannot be read (without it nothing can be
    checked), and `CheckpointPermissionError` if any file may not be read by
    this user: that is no damage, and says nothing of the data. On an object
    store, leaves found damaged are checked again before they are reported
    (the whole checkpoint is read again): bytes that fail differently on each
    read, like a store that fails, raise `ObjectStoreError`, no damage.
    """
    path = find_item(directory)
    if _items.kind_of(path) == _items.PLAIN:
        return verify_plain(path, _plain.read(path), progress)
    return _damage.confirmed(path, lambda: _verify(path, progress), _listed)


def _listed(report: VerifyReport) -> str:
    """What `report` found damaged, as text (empty if nothing)."""
    return "\n".join(f"  - {d.name}: {d.problem}" for d in report.damaged)


def _verify(path: epath.Path, progress) -> VerifyReport:
    saved = read(path)
    checked: list[Any] = []
    damaged: list[Any] = []
    unchecked: list[Any] = []
    total = 0
    note = progress or (lambda n: None)
    parts = [(path, saved)]
    if isinstance(saved, TypedMetadata):  # each group names its own files
        parts = [(g.directory, g.saved) for g in saved.groups]
    for where, part in parts:
        total += _check(where, part, note, checked, damaged, unchecked)
    return VerifyReport(
        str(path), tuple(checked), tuple(damaged), tuple(unchecked), total
    )


def verify_plain(
    path: epath.Path,
    saved: "_plain.PlainMetadata",
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Reads every array of a plain Orbax item back, a block of whole chunks
    at a time (see `plain_read`): one that cannot be read (a missing chunk or
    file, bytes that do not decode, a shape that does not match Orbax's
    metadata) is damaged; the others are `unchecked`, as no checksum exists."""
    note = progress or (lambda n: None)
    damaged, unchecked = [], []
    total = 0
    with StoreReader(path, saved.ocdbt, saved.zarr3) as reader:
        for record in saved.leaves.values():
            try:
                for block in reader.blocks(record, _CHUNK):
                    total += block.nbytes
                    note(block.nbytes)
            except PermissionError:  # not damage: nothing can be said of the data
                raise
            except UnreadableArray as e:
                damaged.append(DamagedLeaf(record.name, record.path, e.problem))
                continue
            except (OrbaxEqxError, OSError) as e:
                problem = str(e).split("\n")[0]
                damaged.append(DamagedLeaf(record.name, record.path, problem))
                continue
            unchecked.append(record.name)
            release_memory()
    return VerifyReport(str(path), (), tuple(damaged), tuple(unchecked), total)


def _check(path: epath.Path, saved: Metadata, note, *lists) -> int:
    """Checks every array of `saved` into `lists`; returns the bytes read."""
    checked, damaged, unchecked = lists
    total = 0
    stored = []
    sharded = [r for r in saved.leaves.values() if r.data == SHARDS]
    if sharded:
        for record, result, n in _check_sharded(path, saved, sharded, note):
            _sort(saved, record, result, checked, damaged, unchecked)
            total += n
    for record in saved.leaves.values():
        if record.data == PACKED:
            result, n = _check_packed(path, saved, record, note)
            _sort(saved, record, result, checked, damaged, unchecked)
            total += n
        elif record.data == STORED:
            stored.append(record)
    if stored:
        with LeafReader(path, saved) as reader:
            for record in stored:
                result = _check_stored(reader, record)
                _sort(saved, record, result, checked, damaged, unchecked)
                total += record.nbytes
                note(record.nbytes)
                release_memory()
    return total


def _sort(saved: Metadata, record: LeafMetadata, result, *lists) -> None:
    """`result`: None if unchecked, True if it matched, else the problem."""
    checked, damaged, unchecked = lists
    # A sidecar that lost a checksum is refused when read; a null `sum32` is
    # an array no process held whole at save: unchecked.
    if result is None:
        unchecked.append(record.name)
    elif result is True:
        checked.append(record.name)
    else:
        damaged.append(DamagedLeaf(record.name, record.path, result))


def _check_packed(path: epath.Path, saved: Metadata, record, note):
    pack = saved.packs[record.pack]
    start, stop = record.offset, record.offset + record.nbytes
    running, done = Running(), 0
    try:
        for piece in range(start, stop, _CHUNK):
            (data,) = _ranges.read(
                path / pack.file,
                [(piece, min(piece + _CHUNK, stop))],
                nbytes=pack.nbytes,
            )
            running.update(data)
            done += data.nbytes
            note(data.nbytes)
    except (PermissionError, ObjectStoreError):  # not damage: nothing can be
        raise  # said of the data
    except (OrbaxEqxError, OSError) as e:
        return str(e).split("\n")[0], done
    if record.checksum is None:
        return None, done
    found = running.value()
    if found != record.checksum:
        return _differs(NAME, record.checksum, found), done
    return True, done


def _check_sharded(path: epath.Path, saved: Metadata, records, note):
    """Yields `(record, result, bytes read)` for each leaf in the shard packs."""
    try:
        chunks = read_all(path, saved)
    except (PermissionError, ObjectStoreError):
        raise
    except (OrbaxEqxError, OSError) as e:
        for record in records:
            yield record, str(e).split("\n")[0], 0
        return
    for record in records:
        done, problem = 0, None
        for chunk in chunks[record.name]:
            # A leaf stops at its first bad block: a damaged (or hostile,
            # sparse, terabytes long) shard pack costs no more than the data
            # read up to there.
            if problem is not None:
                break
            file = path / shard_file(saved.token, chunk.process)
            step = max(_CHUNK // chunk.block, 1) * chunk.block
            try:
                for at in range(0, chunk.nbytes, step):
                    stop = min(at + step, chunk.nbytes)
                    start = chunk.offset + at
                    (data,) = _ranges.read(file, [(start, chunk.offset + stop)])
                    done += data.nbytes
                    note(data.nbytes)
                    # The same check as a restore's
                    # (`_storage/sharded/read.py: check_chunk`).
                    bad = check_blocks(chunk, at, data)
                    if bad:
                        i, recorded, found = bad[0]
                        end = min((i + 1) * chunk.block, chunk.nbytes)
                        problem = (
                            f"chunk {chunk.box()} in {file.name}: "
                            + _differs(NAME, recorded, found)
                            + f" in bytes {i * chunk.block}-{end}"
                        )
                        break  # the leaf is damaged: no need to read on
            except (PermissionError, ObjectStoreError):
                raise
            except (OrbaxEqxError, OSError) as e:
                problem = problem or str(e).split("\n")[0]
            if problem is not None:
                break
        yield record, problem or True, done


def _check_stored(reader: LeafReader, record):
    try:
        (data,) = reader.read([record.name], verify=False).values()
    except (PermissionError, ObjectStoreError):  # not damage: nothing can be
        raise  # said of the data
    except Exception as e:  # whatever Orbax or TensorStore raise on bad files
        return f"cannot be read: {str(e).splitlines()[0] if str(e) else e!r}"
    if record.sum32 is None:
        return None
    found = host_sum32(data)
    if found != record.sum32:
        return _differs("sum32", record.sum32, found)
    return True


def _differs(kind: str, recorded: int, found: int) -> str:
    digits = 18 if kind == NAME else 10  # 64 bits: 16 hexadecimal digits
    return (
        f"data does not match its {kind}: {recorded:#0{digits}x} recorded at "
        f"save, {found:#0{digits}x} computed now"
    )
