"""Reads chosen array leaves of a checkpoint as host numpy arrays, a batch at a time.

For tools that stream through a checkpoint (`diff --values`, `export`): they
never hold more than one batch of leaves, whose size they choose. Reading goes
through the same machinery as restore (`read_arrays`), so names, tied weights
and zero-size arrays mean the same here; restore itself is not changed.
"""

import ctypes
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .._format.sidecar import EMPTY, LeafMetadata, Metadata
from .._tree.walk import JAX, NUMPY, is_key_dtype, parse_dtype
from .restore import _Request, read_arrays


class LeafReader:
    """Reads array leaves of one checkpoint by leaf name.

    **Arguments:**

    - `directory`: the item directory of the checkpoint.
    - `saved`: its sidecar, from `_format.sidecar_read.read(directory)`.

    Use as a context manager, or call `close()`.
    """

    def __init__(self, directory: epath.Path, saved: Metadata):
        self.directory = directory
        self.saved = saved
        self._inner = ocp.PyTreeCheckpointHandler()
        self._device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def read(
        self, names: Iterable[str], *, verify: bool = True
    ) -> dict[str, np.ndarray]:
        """Reads the array leaves `names`, each as a host numpy array.

        Typed PRNG keys come back as their key data (`jax.random.key_data`:
        uint32 with a trailing axis). A tied leaf and its twin are the same
        numpy array. With `verify`, a leaf whose data does not match its
        checksum is an error, as in a restore.
        """
        requests = {}
        for name in names:
            record = self.saved.leaves[name]
            dtype = parse_dtype(record.dtype)
            # Keys are read as jax arrays (numpy cannot hold them); all else
            # straight into host memory, without a device copy.
            kind = JAX if is_key_dtype(dtype) else NUMPY
            requests[name] = _Request(record, dtype, kind, self._device)
        arrays = read_arrays(
            self._inner, self.directory, self.saved, requests, verify=verify
        )
        return {name: _to_host(value) for name, value in arrays.items()}

    def stream(
        self, records: Iterable[LeafMetadata], budget: int
    ) -> Iterator[tuple[LeafMetadata, np.ndarray]]:
        """Yields `(record, array)` in order, holding about `budget` bytes at most.

        Drop each array when done with it: then no more than one batch is held.
        Reading a batch takes about twice its size for a moment (TensorStore's
        buffers, then the arrays: measured), so batches are half of `budget`.
        """
        for batch in batches(records, max(budget // 2, 1)):
            arrays = self.read([record.name for record in batch])
            for record in batch:
                yield record, arrays.pop(record.name)
            del arrays
            release_memory()

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> "LeafReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_host(value: Any) -> np.ndarray:
    if isinstance(value, jax.Array):
        if is_key_dtype(value.dtype):
            value = jax.random.key_data(value)
        return np.asarray(value)
    return np.asarray(value)


def read_cost(record: LeafMetadata) -> int:
    """Bytes that reading `record` brings into memory (a tie counts in full)."""
    return 0 if record.data == EMPTY else record.nbytes


def batches(
    records: Iterable[LeafMetadata], budget: int
) -> Iterator[list[LeafMetadata]]:
    """Groups records, in order, into batches of at most `budget` bytes of data.

    A leaf larger than `budget` is a batch of its own: it is read whole.
    """
    batch: list[LeafMetadata] = []
    size = 0
    for record in records:
        cost = read_cost(record)
        if batch and size + cost > budget:
            yield batch
            batch, size = [], 0
        batch.append(record)
        size += cost
    if batch:
        yield batch


def release_memory() -> None:
    """Hands freed memory back to the OS, where the C library allows it.

    TensorStore reads on many threads; glibc keeps what they free in per-thread
    arenas, so without this a stream of batches ratchets the resident size up
    (measured: 64 MiB batches climbed from +110 MiB to +360 MiB over 512 MiB).
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None
