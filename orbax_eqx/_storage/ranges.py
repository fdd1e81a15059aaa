"""Pack files: byte ranges of one file, written and read at the store's speed.

Reads fill 64-byte-aligned buffers, which `jax.device_put` takes as they are
on CPU, so a restore holds each byte once. A pack is read only if it is a
regular file (a FIFO would block forever, a directory reads as 4096 bytes of
nothing) no longer than its sidecar records. `layout`: where records go;
`plan`: the ranges to read for wanted spans, neighbours merged when close.
"""

import functools
import mmap
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import numpy as np
from etils import epath

from .._bytes import route as _route
from .._bytes import store as _store
from .._errors import CheckpointDamagedError, permission_denied
from .._format.sidecar import PACK_ALIGNMENT as ALIGNMENT

_ZEROS = np.zeros(ALIGNMENT, np.uint8)
K = TypeVar("K", bound=Hashable)  # what names a span


# From this size on numpy asks the kernel for huge pages (`MADV_HUGEPAGE`),
# and a restore's buffers are mapped by the process instead. Under the common
# `defrag=madvise` setting each huge page is found by compacting memory on
# the spot: in a process that has been working (a save, a full page cache)
# filling a fresh 0.5 GiB numpy buffer took 1.1-1.3 s where an anonymous
# mapping of 4 KiB pages took 0.35-0.43 s, and in a fresh process the two
# were within noise (BENCHMARKS.md, "Huge pages").
_MAPPED_FROM = 4 << 20
# Where mmap takes no flags (Windows), numpy's buffers are used at any size.
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer whose first byte is 64-byte aligned
    (a private anonymous mapping, page-aligned, from `_MAPPED_FROM` bytes)."""
    if nbytes >= _MAPPED_FROM and _MAP_FLAGS:
        # Freed with the last array that views it (numpy, or a CPU device's
        # zero-copy jax array, which holds the numpy array).
        mapped = mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)
        return np.frombuffer(mapped, np.uint8)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes]


def as_bytes(x: np.ndarray | memoryview) -> memoryview:
    """The bytes of a C-contiguous array (or a memoryview of bytes, as it is),
    as a flat memoryview: what is written for it, and what its checksum is
    summed over."""
    if type(x) is memoryview:
        return x
    if _buffered(x.dtype):
        try:
            # 0.4 us a small array, against 1.5 through a uint8 view (a save
            # of 50,000 leaves takes each one's bytes once).
            return x.data.cast("B")
        except TypeError:  # not C-contiguous: copied below
            pass
    # Through uint8, because the buffer protocol knows neither bfloat16 nor int4.
    return x.reshape(-1).view(np.uint8).data


@functools.cache
def _buffered(dtype: np.dtype) -> bool:
    """Whether numpy's buffer of an array of `dtype` casts to bytes (its own
    types in native byte order do; ml_dtypes' types have no buffer format)."""
    try:
        np.zeros(1, dtype).data.cast("B")
    except (TypeError, ValueError):
        return False
    return True


def _gaps_and_arrays(pieces, nbytes):
    """The file's contents in order: each array's bytes, zeros between them."""
    cursor = 0
    for offset, x in pieces:
        if offset > cursor:
            gap = offset - cursor
            yield memoryview(_ZEROS[:gap] if gap <= ALIGNMENT else np.zeros(gap, "u1"))
        view = as_bytes(x)
        yield view
        cursor = offset + view.nbytes
    if nbytes > cursor:
        yield memoryview(np.zeros(nbytes - cursor, np.uint8))


def write(
    path: epath.Path,
    pieces: Sequence[tuple[int, np.ndarray | memoryview]],
    nbytes: int,
) -> None:
    """Writes a new file of `nbytes` bytes holding each array at its offset."""
    _route.for_path(path).write_stream(path, _gaps_and_arrays(pieces, nbytes), nbytes)


def read(
    path: epath.Path,
    ranges: Sequence[tuple[int, int]],
    *,
    meanwhile: Callable[[list[np.ndarray], Callable[[int, int], None]], None]
    | None = None,
    nbytes: int | None = None,
    empty: Callable[[int], np.ndarray] = aligned_empty,
) -> list[np.ndarray]:
    """Reads each byte range `[start, stop)` of `path` into its own aligned buffer."""
    end = max((stop for _, stop in ranges), default=0)
    # Opened and checked before allocating: a sidecar claiming absurd sizes
    # must not get to ask for terabytes of memory.
    with _open(path, end, nbytes) as reader:
        buffers = [empty(stop - start) for start, stop in ranges]
        reads = reader.start(ranges, buffers)
        try:
            if meanwhile is not None:
                meanwhile(buffers, _worded(path, reads.ready))
            _worded(path, lambda: reads.wait())()
        finally:
            reads.cancel()
    return buffers


def check_size(path: epath.Path, end: int, nbytes: int | None = None) -> None:
    """Raises `CheckpointDamagedError` unless `path` is a regular file of at
    least `end` bytes and at most `nbytes` (the size the sidecar records, if
    given), as `read` does: before a read is planned or allocated for sizes
    that only a damaged sidecar claims."""
    with _open(path, end, nbytes):
        pass


def _open(path, end: int, nbytes: int | None):
    return open_file(path, end, nbytes, lambda what: damaged(path, what))


def open_file(path, end: int, nbytes: int | None, error: Callable[[str], Exception]):
    """`path` opened for ranged reads up to `end` (see `_bytes.store.Store.open`);
    `error(what)` is the error for a file missing, short or too long."""
    try:
        return _route.for_path(path).open(path, end, nbytes)
    except _store.BadFile as e:
        raise error(e.what) from None
    except FileNotFoundError:
        raise error("is missing") from None
    except PermissionError:
        raise permission_denied(path) from None


def _worded(path, wait):
    """`wait`, raising a `BadFile` as the pack's damage."""

    def worded(*args):
        try:
            return wait(*args)
        except _store.BadFile as e:
            raise damaged(path, e.what) from None

    return worded


def damaged(path, what: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The pack file {path} {what}: the checkpoint is damaged (a copy cut "
        "short, or a file deleted). Restore an earlier step, or re-save it."
    )


def layout(sizes: Iterable[tuple[K, int]]) -> tuple[dict[K, int], int]:
    """Offsets of `(name, nbytes)` leaves packed in order, and the pack's size."""
    offsets, cursor = {}, 0
    for name, size in sizes:
        cursor += -cursor % ALIGNMENT
        offsets[name] = cursor
        cursor += size
    return offsets, cursor


_span = operator.itemgetter(1)  # (of a `(name, span)` pair: no call per leaf)


def plan(
    spans: dict[K, tuple[int, int]], max_gap: int
) -> tuple[list[tuple[int, int]], dict[K, tuple[int, int]]]:
    """Merges byte spans at most `max_gap` apart into few ranges to read."""
    ranges: list[tuple[int, int]] = []
    where: dict[K, tuple[int, int]] = {}
    for name, (start, stop) in sorted(spans.items(), key=_span):
        if ranges and start - ranges[-1][1] <= max_gap:
            first = ranges[-1][0]
            ranges[-1] = (first, max(stop, ranges[-1][1]))
        else:
            first = start
            ranges.append((start, stop))
        where[name] = (len(ranges) - 1, start - first)
    return ranges, where
