"""`inspect --stats`: the numbers in each array, streamed with bounded memory.

Each array is read a piece at a time, straight from where its bytes are (a
range of the pack file, the chunks of the shard packs, Orbax's array store a
block of whole chunks at a time; a plain Orbax checkpoint's store likewise),
so memory stays near `budget` whatever the size of the checkpoint (or one
chunk of Orbax's store, where a chunk is larger). The statistics do not
depend on the order of the elements, so every piece counts once, wherever it
is. Values are read, not checked against their checksums: `verify` does that.

Per leaf: its elements; NaN, infinite and zero elements; and over the finite
ones, the minimum, maximum, mean, standard deviation (of the population) and
L2 norm, computed in float64 (complex numbers: the L2 norm of their moduli
only). Typed PRNG keys hold no numbers: only their count is given. A tied
leaf is its twin's array, read once.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np
from etils import epath

from .._errors import OrbaxEqxError
from .._format.sidecar import (
    ALIAS,
    EMPTY,
    PACKED,
    SHARDS,
    STORED,
    LeafMetadata,
    Metadata,
    arrays_dir,
    shard_file,
)
from .._restore.read import release_memory
from .._storage import ranges as _pack_ranges
from .._storage.sharded.index_read import read_all
from .._tree.walk import ARRAY, parse_dtype
from .plain_items import PlainMetadata
from .plain_read import StoreReader
from .typed_items import TypedMetadata

DEFAULT_BUDGET = 64 << 20  # bytes of array data read at once
_STEP = 1 << 20  # elements widened to float64 at once


@dataclasses.dataclass(frozen=True)
class LeafStats:
    """The numbers in one array leaf (`None` where there are none to take)."""

    name: str
    path: str  # the leaf path
    dtype: str
    shape: tuple[int, ...]
    size: int  # elements (keys, for typed PRNG keys)
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    l2: float | None = None
    keys: bool = False  # typed PRNG keys: counted, no numbers
    error: str | None = None  # why the leaf could not be read


class _Sums:
    """Order-free running statistics, merged piece by piece (Chan et al.)."""

    def __init__(self):
        self.finite = self.nan = self.inf = self.zeros = 0
        self.mean = self.m2 = self.sumsq = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.complex = False

    def add(self, x: np.ndarray) -> None:
        flat = x.reshape(-1)
        for start in range(0, flat.size, _STEP):
            self._add(flat[start : start + _STEP])

    def _add(self, piece: np.ndarray) -> None:
        if np.issubdtype(piece.dtype, np.complexfloating):
            self.complex = True
            wide = piece.astype(np.complex128)
            nan = np.isnan(wide.real) | np.isnan(wide.imag)
            inf = (np.isinf(wide.real) | np.isinf(wide.imag)) & ~nan
            self.nan += int(np.count_nonzero(nan))
            self.inf += int(np.count_nonzero(inf))
            self.zeros += int(np.count_nonzero(wide == 0))
            finite = np.abs(wide[~(nan | inf)])
            self.finite += int(finite.size)
            self.sumsq += float(np.sum(np.square(finite)))
            return
        wide = piece.astype(np.float64)
        nan = np.isnan(wide)
        inf = np.isinf(wide)
        self.nan += int(np.count_nonzero(nan))
        self.inf += int(np.count_nonzero(inf))
        self.zeros += int(np.count_nonzero(wide == 0))
        finite = wide[~(nan | inf)] if self.nan or self.inf else wide
        n = int(finite.size)
        if n == 0:
            return
        mean = float(np.mean(finite))
        m2 = float(np.sum(np.square(finite - mean)))
        total = self.finite + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.finite * n / total
        self.finite = total
        self.sumsq += float(np.sum(np.square(finite)))
        self.min = min(self.min, float(np.min(finite)))
        self.max = max(self.max, float(np.max(finite)))

    def result(self, record: LeafMetadata) -> LeafStats:
        base = _base(record)
        counts = dict(nan=self.nan, inf=self.inf, zeros=self.zeros)
        if self.finite == 0:
            return dataclasses.replace(base, **counts)
        if self.complex:
            return dataclasses.replace(base, **counts, l2=math.sqrt(self.sumsq))
        return dataclasses.replace(
            base,
            **counts,
            min=self.min,
            max=self.max,
            mean=self.mean,
            std=math.sqrt(max(self.m2, 0.0) / self.finite),
            l2=math.sqrt(self.sumsq),
        )


def _base(record: LeafMetadata) -> LeafStats:
    shape = tuple(record.shape or ())
    return LeafStats(
        record.name, record.path, str(record.dtype), shape, math.prod(shape)
    )


def leaf_stats(
    item: epath.Path,
    saved: Metadata,
    *,
    budget: int = DEFAULT_BUDGET,
    progress: Callable[[int], None] | None = None,
) -> Iterator[LeafStats]:
    """Yields the statistics of each array leaf of the item, in the sidecar's
    order (for a plain Orbax item, Orbax's), reading as it goes.

    A leaf that cannot be read is yielded with its `error`; the others are
    still read.
    """
    note = progress or (lambda n: None)
    parts = [(item, saved)]
    if isinstance(saved, TypedMetadata):  # each group names its own files
        parts = [(g.directory, g.saved) for g in saved.groups]
    done: dict[str, LeafStats] = {}
    for where, part in parts:
        source = _Source(where, part, budget, note)
        for record in part.leaves.values():
            if record.kind != ARRAY:
                continue
            twin = record.alias_of if record.data == ALIAS else None
            if twin in done:  # the same array, read already
                result = dataclasses.replace(
                    done[twin], name=record.name, path=record.path
                )
            else:
                source_record = part.leaves.get(twin, record) if twin else record
                result = source.stats(source_record)
                result = dataclasses.replace(result, name=record.name, path=record.path)
            done[record.name] = result
            yield result
            release_memory()


class _Source:
    """Where one item's (or group's) bytes are, read a piece at a time."""

    def __init__(self, item, saved: Metadata, budget: int, note):
        self.item, self.saved, self.budget, self.note = item, saved, budget, note
        self._store: StoreReader | None = None
        self._chunks: dict | None = None

    def stats(self, record: LeafMetadata) -> LeafStats:
        if str(record.dtype).startswith("key<"):
            return dataclasses.replace(_base(record), keys=True)
        sums = _Sums()
        try:
            for piece in self._pieces(record):
                self.note(piece.nbytes)
                sums.add(piece)
        except PermissionError:
            raise
        except (OrbaxEqxError, OSError) as e:
            text = str(e).strip().splitlines()[0] if str(e) else type(e).__name__
            return dataclasses.replace(_base(record), error=text)
        return sums.result(record)

    def _pieces(self, record: LeafMetadata) -> Iterator[np.ndarray]:
        if record.data == EMPTY or not record.nbytes:
            return
        dtype = np.dtype(parse_dtype(record.dtype))
        if isinstance(self.saved, PlainMetadata):
            yield from self._store_reader().blocks(record, self.budget)
        elif record.data == STORED:
            yield from self._store_reader().blocks(record, self.budget)
        elif record.data == PACKED:
            # (the sidecar's reader refused a packed leaf without these)
            assert record.pack is not None and record.offset is not None
            pack = self.saved.packs[record.pack]
            yield from self._ranges(
                self.item / pack.file, record.offset, record.nbytes, dtype, pack.nbytes
            )
        elif record.data == SHARDS:
            if self._chunks is None:
                self._chunks = read_all(self.item, self.saved)
            for chunk in self._chunks[record.name]:
                file = self.item / shard_file(self.saved.token, chunk.process)
                yield from self._ranges(file, chunk.offset, chunk.nbytes, dtype)

    def _ranges(self, file, offset: int, nbytes: int, dtype, size=None):
        step = max(self.budget // dtype.itemsize, 1) * dtype.itemsize
        for at in range(0, nbytes, step):
            stop = min(at + step, nbytes)
            (data,) = _pack_ranges.read(
                file, [(offset + at, offset + stop)], nbytes=size
            )
            yield data.view(dtype)
            del data

    def _store_reader(self) -> StoreReader:
        if self._store is None:
            if isinstance(self.saved, PlainMetadata):
                saved = self.saved
                self._store = StoreReader(self.item, saved.ocdbt, saved.zarr3)
            else:
                self._store = StoreReader(arrays_dir(self.item, self.saved.token))
        return self._store
