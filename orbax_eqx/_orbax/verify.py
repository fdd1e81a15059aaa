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
    pack_path,
)
from .._restore.read import LeafReader, release_memory
from .._storage import ranges as _ranges
from .._storage.orbax_store.read import storage_error
from .._storage.sharded.index import check_blocks
from .._storage.sharded.index_read import chunk_path, read_all
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
    found = _Found(progress or (lambda n: None), on_piece or (lambda r, d: None))
    if isinstance(saved, PlainMetadata):
        found.plain(path, saved)
    elif isinstance(saved, _items.TypedMetadata):  # each group names its files
        for group in saved.groups:
            found.item(group.directory, group.saved)
    else:
        found.item(path, saved)
    return VerifyReport(
        str(path),
        tuple(found.checked),
        tuple(found.damaged),
        tuple(found.unchecked),
        found.total,
    )


class _Found:
    """What one `check` found so far, and the bytes it read."""

    def __init__(self, note: Callable[[int], None], piece: OnPiece):
        self.note, self.piece = note, piece
        self.checked: list[str] = []
        self.damaged: list[DamagedLeaf] = []
        self.unchecked: list[str] = []
        self.total = 0

    def read(self, nbytes: int) -> None:
        self.total += nbytes
        self.note(nbytes)

    def sort(self, record: LeafMetadata, result) -> None:
        """`result`: None if unchecked, True if it matched, else the problem."""
        # A sidecar that lost a checksum is refused when read; a null `sum32` is
        # an array no process held whole at save: unchecked.
        if result is None:
            self.unchecked.append(record.name)
        elif result is True:
            self.checked.append(record.name)
        else:
            self.damaged.append(DamagedLeaf(record.name, record.path, result))

    def plain(self, path, saved: PlainMetadata) -> None:
        """Every array of a plain Orbax item read back, a block of whole chunks
        at a time: one that cannot be read (a missing chunk or file, bytes that
        do not decode, a shape that does not match Orbax's metadata) is
        damaged, the others `unchecked`, as no checksum exists."""
        with StoreReader(path, saved.ocdbt, saved.zarr3) as reader:
            for record in saved.leaves.values():
                try:
                    for block in reader.blocks(record, _CHUNK):
                        self.read(block.nbytes)
                        self.piece(record, block)
                except _NOT_DAMAGE:
                    raise
                except UnreadableArray as e:
                    self.sort(record, e.problem)
                    continue
                except (OrbaxEqxError, OSError) as e:
                    self.sort(record, _first_line(e))
                    continue
                self.sort(record, None)
                release_memory()

    def item(self, path: epath.Path, saved: Metadata) -> None:
        sharded = [r for r in saved.leaves.values() if r.data == SHARDS]
        if sharded:
            self.sharded(path, saved, sharded)
        for record in saved.leaves.values():
            if record.data == PACKED:
                self.sort(record, self.packed(path, saved, record))
        stored = [r for r in saved.leaves.values() if r.data == STORED]
        if stored:
            with LeafReader(path, saved) as reader:
                for record in stored:
                    self.sort(record, self.stored(reader, record))
                    self.read(record.nbytes)
                    release_memory()

    def packed(self, path: epath.Path, saved: Metadata, record):
        pack = saved.packs[record.pack]
        start, stop = record.offset, record.offset + record.nbytes
        running = Running()
        try:
            for at in range(start, stop, _CHUNK):
                span = [(at, min(at + _CHUNK, stop))]
                (data,) = _ranges.read(pack_path(path, pack), span, nbytes=pack.nbytes)
                running.update(data)
                self.read(data.nbytes)
                self.piece(record, data)
        except _NOT_DAMAGE:
            raise
        except (OrbaxEqxError, OSError) as e:
            return _first_line(e)
        if record.checksum is None:
            return None
        found = running.value()
        return (
            True if found == record.checksum else _differs(NAME, record.checksum, found)
        )

    def sharded(self, path: epath.Path, saved: Metadata, records) -> None:
        try:
            chunks = read_all(path, saved)
        except _NOT_DAMAGE:
            raise
        except (OrbaxEqxError, OSError) as e:
            for record in records:
                self.sort(record, _first_line(e))
            return
        for record in records:
            problem = None
            for chunk in chunks[record.name]:
                # A leaf stops at its first bad block: a damaged (or hostile,
                # sparse, terabytes long) shard pack costs no more than the data
                # read up to there.
                try:
                    problem = self.chunk(path, saved, record, chunk)
                except _NOT_DAMAGE:
                    raise
                except (OrbaxEqxError, OSError) as e:
                    problem = _first_line(e)
                if problem is not None:
                    break
            self.sort(record, problem or True)

    def chunk(self, path: epath.Path, saved: Metadata, record, chunk) -> str | None:
        """Reads one chunk of a shard pack; the problem of its first bad block."""
        file = chunk_path(path, chunk)
        step = max(_CHUNK // chunk.block, 1) * chunk.block
        for at in range(0, chunk.nbytes, step):
            stop = chunk.offset + min(at + step, chunk.nbytes)
            (data,) = _ranges.read(file, [(chunk.offset + at, stop)])
            self.read(data.nbytes)
            # The same check as a restore's (`_storage/read.py`).
            bad = check_blocks(chunk, at, data)
            if bad:
                i, recorded, found = bad[0]
                end = min((i + 1) * chunk.block, chunk.nbytes)
                return (
                    f"chunk {chunk.box()} in {file.name}: "
                    + _differs(NAME, recorded, found)
                    + f" in bytes {i * chunk.block}-{end}"
                )
            self.piece(record, data)
        return None

    def stored(self, reader: LeafReader, record):
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
        self.piece(record, data)
        if record.sum32 is None:
            return None
        found = host_sum32(data)
        return True if found == record.sum32 else _differs("sum32", record.sum32, found)


def _first_line(error: BaseException) -> str:
    return str(error).split("\n")[0]


def _differs(kind: str, recorded: int, found: int) -> str:
    digits = 18 if kind == NAME else 10  # 64 bits: 16 hexadecimal digits
    return (
        f"data does not match its {kind}: {recorded:#0{digits}x} recorded at "
        f"save, {found:#0{digits}x} computed now"
    )
