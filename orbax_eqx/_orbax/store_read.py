"""Reads arrays of Orbax's array store a block at a time, through TensorStore.

For `verify` and the command line on plain Orbax checkpoints (and on the
Orbax-stored leaves of orbax_eqx ones): each array is opened from a
TensorStore spec that Orbax's public `ocp.type_handlers.get_json_tspec_read`
builds (zarr or zarr3, OCDBT or one directory per array), with missing chunks
an error rather than zeros, and read one block of whole chunks at a time:
memory stays near the budget, or one chunk where a chunk is larger (Orbax
writes one chunk per shard).
"""

import itertools
import math
import os
import re
from collections.abc import Iterable, Iterator

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from .._errors import CheckpointDamagedError
from .._format.sidecar import LeafMetadata
from .._restore.read import batches, release_memory

# Seconds one open or read may take: a local read never comes near, and a
# stalled remote one fails rather than hangs.
TIMEOUT = 300.0
_OCDBT_CACHE = 16 << 20  # bytes of OCDBT's b-tree nodes kept
# Bytes of a block read at once, at most: TensorStore holds each chunk's
# compressed and decoded bytes besides the block while it reads, so smaller
# blocks keep the peak near the budget (measured: benchmarks/stats_memory.py).
MAX_BLOCK = 16 << 20


class StoreReader:
    """Reads arrays of one Orbax array store by their Orbax names.

    **Arguments:**

    - `directory`: the store (a plain item's directory, or an orbax_eqx
        item's `orbax_eqx~arrays.<token>`).
    - `ocdbt`, `zarr3`: its layout; None: found out from the files (OCDBT
        from Orbax's own test, zarr3 by trying it where zarr fails).
    """

    def __init__(
        self,
        directory: epath.Path,
        ocdbt: bool | None = None,
        zarr3: bool | None = None,
    ):
        self.directory = directory
        if ocdbt is None:
            ocdbt = bool(ocp.type_handlers.is_ocdbt_checkpoint(directory))
        self.ocdbt = ocdbt
        self.zarr3 = zarr3
        # Orbax's context, with a smaller cache for OCDBT's b-tree nodes:
        # Orbax's 100 MB would be held on top of the blocks being read.
        spec = ocp.type_handlers.get_ts_context().spec.to_json()
        spec["cache_pool#ocdbt"] = {"total_bytes_limit": _OCDBT_CACHE}
        self._context = ts.Context(spec)

    def open(self, record: LeafMetadata) -> ts.TensorStore:
        """Opens the array of `record` (by `record.key`), checked against it."""
        tries = [self.zarr3] if self.zarr3 is not None else [False, True]
        error: Exception | None = None
        for zarr3 in tries:
            info = ocp.type_handlers.ParamInfo(
                name=record.key,
                parent_dir=self.directory,
                is_ocdbt_checkpoint=self.ocdbt,
                use_zarr3=zarr3,
                ts_context=self._context,
            )
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.ocdbt)
            spec["fill_missing_data_reads"] = False  # a lost chunk is no zeros
            try:
                store = ts.open(
                    spec, open=True, read=True, context=self._context
                ).result(timeout=TIMEOUT)
            except Exception as e:  # TensorStore's: NOT_FOUND, DATA_LOSS...
                error = e
                continue
            self._check(record, store)
            return store
        raise _unreadable(record, self.directory, error)

    def _check(self, record: LeafMetadata, store: ts.TensorStore) -> None:
        shape = tuple(int(d) for d in store.shape)
        dtype = np.dtype(store.dtype.numpy_dtype)
        if shape != tuple(record.shape or ()) or str(dtype) != record.dtype:
            raise _damaged(
                record,
                f"the metadata says shape {tuple(record.shape or ())} and dtype "
                f"{record.dtype}, its array in {self.directory} has {shape} and "
                f"{dtype}: the checkpoint is damaged or mixed from two saves",
            )
        chunk = _chunk_shape(store)
        nbytes = math.prod(chunk) * dtype.itemsize
        if nbytes > max_chunk():
            raise _damaged(
                record,
                f"is stored in chunks of {chunk} ({nbytes} bytes), more than half "
                "of this machine's memory: reading one would not fit; read it on "
                "a larger machine",
            )

    def blocks(self, record: LeafMetadata, budget: int) -> Iterator[np.ndarray]:
        """Yields the array of `record` in blocks of whole chunks, in no
        particular order, each about `budget` bytes (or one chunk, if larger)."""
        store = self.open(record)
        shape = tuple(int(d) for d in store.shape)
        if math.prod(shape) == 0:
            return
        block = _block_shape(
            shape, _chunk_shape(store), store.dtype.numpy_dtype, min(budget, MAX_BLOCK)
        )
        ranges = [range(0, n, b) for n, b in zip(shape, block, strict=True)]
        for start in itertools.product(*ranges):
            box = tuple(
                slice(a, min(a + b, n))
                for a, b, n in zip(start, block, shape, strict=True)
            )
            try:
                data = store[box].read().result(timeout=TIMEOUT)
            except Exception as e:
                raise _unreadable(record, self.directory, e) from e
            yield np.asarray(data)
            del data

    def read(self, record: LeafMetadata) -> np.ndarray:
        """The whole array of `record`."""
        store = self.open(record)
        try:
            return np.asarray(store.read().result(timeout=TIMEOUT))
        except Exception as e:
            raise _unreadable(record, self.directory, e) from e

    def stream(
        self, records: Iterable[LeafMetadata], budget: int
    ) -> Iterator[tuple[LeafMetadata, np.ndarray]]:
        """Yields `(record, array)` in order, holding about `budget` bytes at
        most (as `LeafReader.stream` does)."""
        for batch in batches(records, max(budget // 2, 1)):
            for record in batch:
                yield record, self.read(record)
            release_memory()

    def close(self) -> None:
        pass

    def __enter__(self) -> "StoreReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def max_chunk() -> int:
    """The largest chunk read: half of this machine's memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _chunk_shape(store: ts.TensorStore) -> tuple[int, ...]:
    shape = tuple(int(d) for d in store.shape)
    chunk = store.chunk_layout.read_chunk.shape
    if chunk is None:
        return shape
    return tuple(
        max(1, min(int(c), n)) if c else max(n, 1)
        for c, n in zip(chunk, shape, strict=False)
    )


def _block_shape(shape, chunk, dtype, budget: int) -> tuple[int, ...]:
    """Whole chunks, grown along the leading axes while within `budget`."""
    block = list(chunk)
    itemsize = np.dtype(dtype).itemsize
    for axis in range(len(shape)):
        others = math.prod(block) // max(block[axis], 1) * itemsize
        fit = max(budget // max(others, 1), 1)
        grown = max(fit // chunk[axis], 1) * chunk[axis]
        block[axis] = min(max(grown, chunk[axis]), max(shape[axis], 1))
        if block[axis] < shape[axis]:
            break  # the block is full: the axes after it stay one chunk
    return tuple(block)


class UnreadableArray(CheckpointDamagedError):
    """An array of Orbax's store that cannot be read; `problem` says why,
    after the leaf's name."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


def _damaged(record: LeafMetadata, problem: str) -> UnreadableArray:
    return UnreadableArray(f"Leaf `{record.path}` ({record.name}): {problem}.", problem)


def _unreadable(record: LeafMetadata, directory, error) -> UnreadableArray:
    return _damaged(
        record,
        f"cannot be read from Orbax's array store at {directory}: "
        + tensorstore_text(error),
    )


# What TensorStore appends to its errors: the whole spec it opened (kilobytes
# of JSON) and where in its C++ sources the error arose.
_APPENDED = re.compile(r"\s*\[(tensorstore_spec|source locations)='.*?'\]", re.S)
_MAX_TEXT = 240  # characters of a library's error kept in ours, at most


def without_specs(text: str) -> str:
    """`text` without the specs and source locations TensorStore appends."""
    return _APPENDED.sub("", text)


def tensorstore_text(error: BaseException | None) -> str:
    """The first line of a TensorStore (or Orbax) error, without the spec it
    appends, cut to a few hundred characters: its start and its end, which
    says what was wrong ("Invalid bool value")."""
    text = without_specs(str(error or "")).strip()
    line = text.splitlines()[0] if text else repr(error)
    half = (_MAX_TEXT - 5) // 2
    return line if len(line) <= _MAX_TEXT else f"{line[:half]} ... {line[-half:]}"
