"""`verify`: read every array of a checkpoint and check it against its checksum.

`check` is the one pass over a checkpoint's array data, piece by piece; it
hands each piece to an optional callback, so that `inspect --stats` counts
the values of the very bytes that were checked.
"""

import dataclasses
import os
from collections.abc import Callable

import numpy as np
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
from .._storage.orbax_store.read import storage_error
from .._storage.sharded.index import check_blocks
from .._storage.sharded.index_read import read_all
from . import items as _items
from .plain import PlainMetadata, StoreReader, UnreadableArray, tensorstore_text

_CHUNK = 64 << 20  # bytes read at a time
# Called with each leaf's record and each piece of its data, as read (bytes
# for packed and sharded leaves, typed arrays from Orbax's store).
OnPiece = Callable[[LeafMetadata, np.ndarray], None]
# Not damage, whatever the data: nothing can be said of it.
_NOT_DAMAGE = (PermissionError, ObjectStoreError)


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
        with `checksums=False`, Orbax-stored arrays no process held whole, or
        a plain Orbax checkpoint's); their data was read, not checked.
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
        Orbax checkpoint, whose arrays are read back a block at a time (Orbax
        records no checksums: every one is `unchecked` unless it cannot be
        read).
    - `progress`: called with the bytes of each piece read (for a progress bar).

    **Returns:** a `VerifyReport`; `report.ok` is False if any leaf is damaged.
    Raises if the sidecar itself cannot be read (without it nothing can be
    checked), and `CheckpointPermissionError` if any file may not be read by
    this user: that is no damage, and says nothing of the data. On an object
    store, leaves found damaged are checked again before they are reported
    (the whole checkpoint is read again): bytes that fail differently on each
    read, like a store that fails, raise `ObjectStoreError`, no damage.
    """
    path = _items.find_item(directory)
    if _items.kind_of(path) == _items.PLAIN:
        return check(path, _items.read(path), progress)
    return _damage.confirmed(
        path, lambda: check(path, _items.read(path), progress), _listed
    )


def _listed(report: VerifyReport) -> str:
    """What `report` found damaged, as text (empty if nothing)."""
    return "\n".join(f"  - {d.name}: {d.problem}" for d in report.damaged)


def check(
    path: epath.Path,
    saved: Metadata,
    progress: Callable[[int], None] | None = None,
    on_piece: OnPiece | None = None,
) -> VerifyReport:
    """Checks every array of the item at `path`, whose metadata is `saved`
    (as `items.read` gives it), once, without the object store's second read."""
    lists: tuple[list, list, list] = ([], [], [])
    note = progress or (lambda n: None)
    piece = on_piece or (lambda record, data: None)
    total = 0
    if isinstance(saved, PlainMetadata):
        total = _check_plain(path, saved, note, piece, lists)
    elif isinstance(saved, _items.TypedMetadata):  # each group names its files
        for group in saved.groups:
            total += _check(group.directory, group.saved, note, piece, lists)
    else:
        total = _check(path, saved, note, piece, lists)
    checked, damaged, unchecked = lists
    return VerifyReport(
        str(path), tuple(checked), tuple(damaged), tuple(unchecked), total
    )


def _check_plain(path, saved: PlainMetadata, note, piece, lists) -> int:
    """Every array of a plain Orbax item read back, a block of whole chunks at
    a time: one that cannot be read (a missing chunk or file, bytes that do not
    decode, a shape that does not match Orbax's metadata) is damaged, the
    others `unchecked`, as no checksum exists."""
    total = 0
    with StoreReader(path, saved.ocdbt, saved.zarr3) as reader:
        for record in saved.leaves.values():
            try:
                for block in reader.blocks(record, _CHUNK):
                    total += block.nbytes
                    note(block.nbytes)
                    piece(record, block)
            except _NOT_DAMAGE:
                raise
            except UnreadableArray as e:
                _sort(record, e.problem, lists)
                continue
            except (OrbaxEqxError, OSError) as e:
                _sort(record, _first_line(e), lists)
                continue
            _sort(record, None, lists)
            release_memory()
    return total


def _check(path: epath.Path, saved: Metadata, note, piece, lists) -> int:
    """Checks every array of `saved` into `lists`; returns the bytes read."""
    total = 0
    sharded = [r for r in saved.leaves.values() if r.data == SHARDS]
    if sharded:
        for record, result, n in _check_sharded(path, saved, sharded, note, piece):
            _sort(record, result, lists)
            total += n
    for record in saved.leaves.values():
        if record.data == PACKED:
            result, n = _check_packed(path, saved, record, note, piece)
            _sort(record, result, lists)
            total += n
    stored = [r for r in saved.leaves.values() if r.data == STORED]
    if stored:
        with LeafReader(path, saved) as reader:
            for record in stored:
                _sort(record, _check_stored(reader, record, piece), lists)
                total += record.nbytes
                note(record.nbytes)
                release_memory()
    return total


def _sort(record: LeafMetadata, result, lists) -> None:
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


def _check_packed(path: epath.Path, saved: Metadata, record, note, piece):
    pack = saved.packs[record.pack]
    start, stop = record.offset, record.offset + record.nbytes
    running, done = Running(), 0
    try:
        for at in range(start, stop, _CHUNK):
            span = [(at, min(at + _CHUNK, stop))]
            (data,) = _ranges.read(path / pack.file, span, nbytes=pack.nbytes)
            running.update(data)
            done += data.nbytes
            note(data.nbytes)
            piece(record, data)
    except _NOT_DAMAGE:
        raise
    except (OrbaxEqxError, OSError) as e:
        return _first_line(e), done
    if record.checksum is None:
        return None, done
    found = running.value()
    if found != record.checksum:
        return _differs(NAME, record.checksum, found), done
    return True, done


def _check_sharded(path: epath.Path, saved: Metadata, records, note, piece):
    """Yields `(record, result, bytes read)` for each leaf in the shard packs."""
    try:
        chunks = read_all(path, saved)
    except _NOT_DAMAGE:
        raise
    except (OrbaxEqxError, OSError) as e:
        for record in records:
            yield record, _first_line(e), 0
        return
    for record in records:
        done, problem = 0, None
        for chunk in chunks[record.name]:
            # A leaf stops at its first bad block: a damaged (or hostile,
            # sparse, terabytes long) shard pack costs no more than the data
            # read up to there.
            file = path / shard_file(saved.token, chunk.process)
            step = max(_CHUNK // chunk.block, 1) * chunk.block
            try:
                for at in range(0, chunk.nbytes, step):
                    stop = chunk.offset + min(at + step, chunk.nbytes)
                    span = [(chunk.offset + at, stop)]
                    (data,) = _ranges.read(file, span)
                    done += data.nbytes
                    note(data.nbytes)
                    # The same check as a restore's (`sharded/read.py`).
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
                    piece(record, data)
            except _NOT_DAMAGE:
                raise
            except (OrbaxEqxError, OSError) as e:
                problem = problem or _first_line(e)
            if problem is not None:
                break
        yield record, problem or True, done


def _check_stored(reader: LeafReader, record, piece):
    try:
        (data,) = reader.read([record.name], verify=False).values()
    except _NOT_DAMAGE:
        raise
    except Exception as e:  # whatever Orbax or TensorStore raise on bad files
        if isinstance(e, OrbaxEqxError) and e.__cause__ is None:
            return f"cannot be read: {e}"  # ours, whole
        # TensorStore's own words, from under ours where a read wrapped them.
        told = storage_error(e.__cause__ or e) or tensorstore_text(e)
        return f"cannot be read: {told}"
    piece(record, data)
    if record.sum32 is None:
        return None
    found = host_sum32(data)
    if found != record.sum32:
        return _differs("sum32", record.sum32, found)
    return True


def _first_line(error: BaseException) -> str:
    return str(error).split("\n")[0]


def _differs(kind: str, recorded: int, found: int) -> str:
    digits = 18 if kind == NAME else 10  # 64 bits: 16 hexadecimal digits
    return (
        f"data does not match its {kind}: {recorded:#0{digits}x} recorded at "
        f"save, {found:#0{digits}x} computed now"
    )
