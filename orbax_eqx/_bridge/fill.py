"""Leaves filled from safetensors files by ranged reads, onto any sharding.

For each array leaf, the target sharding says which box each of this
process's devices holds; boxes held by several devices (replicas) are made
once. The plan (`plan.Plan.leaf_pieces`) says which box of which tensor holds
each part of a box. A tensor is stored in C order at a known offset, so the
part of it a piece needs is the byte range from the piece's first element to
its last: a run of rows (a box that is a column strip of a tensor reads the
rows that hold it, the only bytes read beyond a process's share).

A piece is read straight into its place in the box's buffer, no copy, when
both sides are one contiguous run of the same bytes: the same dtype, axes in
the same order, the tensor's part and the box's part each one range in C
order (a whole layer of a stacked leaf, a run of rows of a layer). Anything
else (a transpose, a cast, a column strip) is read into its batch's arena
(`buffers.Arena`: two, reused batch after batch, so their pages are faulted
in once; measured on 8 CPU devices, 2 cores: the load's system time 1.5 s
-> 1.15 s for 1.32 GiB) and copied into place.

Pieces are copied in by `PLACERS` threads as their bytes arrive, while the
next batch is read. Work goes a batch at a time, in the order of the bytes in
the files (so a
tensor that several leaves need, a fused qkv, is read once): a batch stops
growing once its reads reach `window` bytes, its copied reads `copy_window`
(at least 1 MiB, at most `COPY_WINDOW`, an eighth of the bytes this process
holds), or it has `PIECES` pieces, so what is held beyond the boxes
themselves stays bounded whatever the model's size (one piece larger than
that is a batch of its own). Each leaf's array is made once its last piece
is in, with one `jax.make_array_from_callback` (the boxes' buffers are
aligned, taken as they are on CPU): no computation, no collective. A leaf
none of whose boxes is on this process is made with its dtype and no data.
"""

import collections
import concurrent.futures
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._bytes import route as _route
from .._bytes import store as _store
from .._mapping.pieces import Box, Piece, shape, to_leaf
from .._mapping.plan import Plan
from .._storage.boxes import contiguous, strides_of
from .._storage.ranges import aligned_empty
from .._storage.ranges import plan as merge
from .buffers import Arena, copy
from .safetensors.dtypes import numpy_dtype
from .safetensors.header import Header, SafetensorsError, TensorInfo

DEFAULT_WINDOW = 1 << 30
# Copied bytes in flight per batch (two batches at once). Measured on 16
# cores (benchmarks/bridge_stages.py, GPT-2's 1.32 GiB, 1.21 GB of it
# transposed): with 64 MiB the reads waited on the copies, 1.29x the raw
# read; with 256 MiB (an eighth of the share caps it at 169 MiB there) and
# 8 placers, 1.06x, peak memory 1.20x the share.
COPY_WINDOW = 256 << 20
MIN_COPY_WINDOW = 1 << 20
PIECES = 4096
# Threads copying pieces into place (numpy lets go of the GIL while it
# copies): a transpose costs several times a read of the same bytes.
PLACERS = min(8, os.cpu_count() or 1)
GAP = 0  # copied ranges are read as one where they touch or overlap only
_LITTLE = sys.byteorder == "little"


@dataclasses.dataclass(frozen=True)
class Request:
    """One array leaf to fill (for a typed PRNG key: its key data)."""

    leaf: str  # leaf name, as the plan knows it
    shape: tuple[int, ...]
    dtype: np.dtype  # what the leaf holds
    sharding: Any  # a jax Sharding; None for a numpy leaf (one box, whole)


@dataclasses.dataclass
class _Box:
    """One distinct box of a leaf on this process, and its buffer once made."""

    start: tuple[int, ...]
    stop: tuple[int, ...]
    pieces: list[Piece]
    buffer: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class _Work:
    request: Request
    box: _Box
    piece: Piece
    info: TensorInfo
    path: str
    size: int  # of the file, as its header says
    first: int  # the piece's bytes in the file: [first, stop)
    stop: int
    direct: int | None  # where the bytes go in the box's buffer, if read there


@dataclasses.dataclass
class Counts:
    """What a fill read: bytes, and of them the bytes read to be copied."""

    read: int = 0
    copied: int = 0
    held: int = 0  # bytes of the boxes this process holds


def fill(
    plan: Plan,
    tensors: dict[str, tuple[Header, TensorInfo]],
    requests: list[Request],
    *,
    window: int = DEFAULT_WINDOW,
    counts: Counts | None = None,
    advance: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Reads `requests` from the tensors (`{name: (header, info)}`) the plan
    names; returns `{leaf: array}` (numpy for a request without sharding).
    `advance(nbytes)` is told the bytes of each batch once it is read."""
    counts = counts if counts is not None else Counts()
    boxes = {r.leaf: _boxes(plan, r) for r in requests}
    held = sum(
        math.prod(shape(_box_of(b))) * r.dtype.itemsize
        for r in requests
        for b in boxes[r.leaf]
    )
    counts.held += held
    copy_window = min(COPY_WINDOW, max(MIN_COPY_WINDOW, held // 8))
    left = {r.leaf: sum(len(b.pieces) for b in boxes[r.leaf]) for r in requests}
    out: dict[str, Any] = {}
    works = []
    for r in requests:
        if left[r.leaf] == 0:  # zero-size, or nothing on this process
            out[r.leaf] = _finish(r, boxes[r.leaf])
            continue
        for box in boxes[r.leaf]:
            works += [_work(r, box, piece, tensors) for piece in box.pieces]
    # In file order: a tensor several leaves need (a fused qkv) is read once,
    # and a disk reads forward.
    works.sort(key=lambda w: (w.path, w.first))
    batches: list[tuple[list[_Work], int]] = []
    batch: list[_Work] = []
    staged = copied = 0
    for work in works:
        full = staged >= window or copied >= copy_window or len(batch) >= PIECES
        # Never between two pieces of one tensor: each tensor's bytes once.
        if full and batch[-1].piece.tensor != work.piece.tensor:
            batches.append((batch, staged))
            batch, staged, copied = [], 0, 0
        batch.append(work)
        staged += work.stop - work.first
        copied += 0 if work.direct is not None else work.stop - work.first
    if batch:
        batches.append((batch, staged))
    # Two batches in flight: the next one's reads run while this one's pieces
    # are copied into place (a transpose costs about what reading it does).
    pending: _Batch | None = None
    placers = concurrent.futures.ThreadPoolExecutor(PLACERS)
    # Two batches in flight, each reading its copied pieces into an arena of
    # its own: the same pages every batch, faulted in once, not a fresh
    # mapping per batch (the kernel zeroes each new page: as costly as
    # reading it).
    arenas = [Arena(copy_window), Arena(copy_window)]
    try:
        for k, (batch, staged) in enumerate(batches):
            started = _Batch(batch, counts, placers, arenas[k % 2])
            if pending is not None:
                _complete(pending, left, boxes, out, advance)
            pending = started
        if pending is not None:
            _complete(pending, left, boxes, out, advance)
            pending = None
    finally:
        if pending is not None:
            pending.cancel()
        placers.shutdown(wait=True, cancel_futures=True)
    return {r.leaf: out[r.leaf] for r in requests}


def _complete(batch: "_Batch", left, boxes, out, advance) -> None:
    batch.finish()
    if advance is not None:
        advance(batch.staged)
    _finish_done(batch.works, left, boxes, out)


def _boxes(plan: Plan, r: Request) -> list[_Box]:
    """The distinct boxes of `r` on this process's devices, with their pieces."""
    if r.sharding is None:
        found = {(tuple(0 for _ in r.shape), r.shape): None}
    else:
        found = {}
        for index in r.sharding.addressable_devices_indices_map(r.shape).values():
            found.setdefault(_bounds(index, r.shape), None)
    out = []
    for start, stop in found:
        box = tuple(zip(start, stop, strict=True))
        empty = any(a >= b for a, b in box)
        pieces = [] if empty else plan.leaf_pieces(r.leaf, box)
        out.append(_Box(start, stop, pieces))
    return out


def _bounds(index, full) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start, stop = [], []
    for s, n in zip(index, full, strict=True):
        a, b, _ = s.indices(n)
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


def _box_of(b: _Box) -> Box:
    return tuple(zip(b.start, b.stop, strict=True))


def _buffer(r: Request, b: _Box) -> np.ndarray:
    if b.buffer is None:
        dims = shape(_box_of(b))
        raw = aligned_empty(math.prod(dims) * r.dtype.itemsize)
        b.buffer = raw.view(r.dtype).reshape(dims)
    return b.buffer


def _work(r: Request, b: _Box, p: Piece, tensors) -> _Work:
    header, info = tensors[p.tensor]
    size = numpy_dtype(info.dtype).itemsize
    strides = strides_of(info.shape, size)
    part = shape(p.tensor_box)
    first = sum(a * s for (a, _), s in zip(p.tensor_box, strides, strict=True))
    last = (
        sum((z - 1) * s for (_, z), s in zip(p.tensor_box, strides, strict=True)) + size
    )
    if math.prod(part) == 0:
        last = first
    direct = None
    inner = tuple(z - a for a, z in p.leaf_box)
    outer = tuple(z - a for a, z in zip(b.start, b.stop, strict=True))
    if (
        numpy_dtype(info.dtype) == r.dtype
        and (_LITTLE or size == 1)
        and p.perm == tuple(range(len(p.perm)))
        and contiguous(part, info.shape)
        and contiguous(inner, outer)
    ):
        at = sum(
            (a - s) * st
            for (a, _), s, st in zip(
                p.leaf_box, b.start, strides_of(outer, size), strict=True
            )
        )
        direct = at
    return _Work(
        r,
        b,
        p,
        info,
        header.path,
        header.size,
        info.start + first,
        info.start + last,
        direct,
    )


class _Batch:
    """A batch's reads, started (file by file, each file's ranges in order),
    then finished: each piece to copy is copied into place as soon as its
    bytes are in, while later ones are still being read."""

    def __init__(
        self,
        works: list[_Work],
        counts: Counts,
        placers,
        arena: "Arena | None" = None,
    ):
        self.works = works
        self._arena = arena if arena is not None else Arena(0)
        self._arena.reset()
        self._placers = placers
        self.staged = sum(w.stop - w.first for w in works)
        self._files: list[tuple] = []
        by_file: dict[str, list[_Work]] = collections.defaultdict(list)
        for w in works:
            _buffer(w.request, w.box)
            if w.stop > w.first:
                by_file[w.path].append(w)
        try:
            for path, mine in by_file.items():
                self._files.append(self._start(path, mine, counts))
        except BaseException:
            self.cancel()
            raise

    def _start(self, path: str, works: list[_Work], counts: Counts):
        ranges: list[tuple[int, int]] = []
        buffers: list[np.ndarray] = []
        for w in works:
            if w.direct is not None:
                raw = _made(w.box).reshape(-1).view(np.uint8)
                ranges.append((w.first, w.stop))
                buffers.append(raw[w.direct : w.direct + w.stop - w.first])
        copies = sorted((w for w in works if w.direct is None), key=lambda w: w.first)
        spans = {str(i): (w.first, w.stop) for i, w in enumerate(copies)}
        merged, where = merge(spans, max_gap=GAP)
        temps = [self._arena.take(z - a) for a, z in merged]
        first = len(ranges)  # ranges[first + k] is merged[k]
        ranges += merged
        buffers += temps
        order = sorted(range(len(ranges)), key=lambda k: ranges[k][0])
        slot = {k: j for j, k in enumerate(order)}  # where each range is read
        counts.read += sum(z - a for a, z in ranges)
        counts.copied += sum(z - a for a, z in merged)
        size = works[0].size
        reader, reads = _open(
            path, size, [ranges[k] for k in order], [buffers[k] for k in order]
        )
        jobs = [
            (w, slot[first + where[str(i)][0]], where[str(i)][0], where[str(i)][1])
            for i, w in enumerate(copies)
        ]
        return path, size, reader, reads, jobs, temps

    def finish(self) -> None:
        try:
            while self._files:
                path, size, reader, reads, jobs, temps = self._files[0]
                placed = []
                try:
                    with _worded(path, size):
                        for w, k, m, at in jobs:
                            reads.ready(k, at + w.stop - w.first)
                            part = temps[m][at : at + w.stop - w.first]
                            placed.append(self._placers.submit(_place, w, part))
                        reads.wait()
                finally:
                    for done in placed:  # every copy finished before going on
                        done.result()
                reads.cancel()
                reader.close()
                self._files.pop(0)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Abandons what is still being read (after an error); never raises."""
        for _, _, reader, reads, _, _ in self._files:
            reads.cancel()
            reader.close()
        self._files = []


class _worded:
    """Turns a store's `BadFile` into the error for a file replaced since its
    header was read."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, tb) -> None:
        if kind is not None and issubclass(kind, (_store.BadFile, FileNotFoundError)):
            what = error.what if isinstance(error, _store.BadFile) else "is missing"
            raise SafetensorsError(
                f"{self.path} {what} (its header was read from a {self.size}-byte "
                "file); it was replaced while being read. Load it again."
            ) from None


def _open(path: str, size: int, ranges, buffers):
    """Opens `path` (checked to be of `size` bytes still) and starts reading
    `ranges` into `buffers`; returns the reader and its reads."""
    with _worded(path, size):
        reader = _route.for_path(path).open(path, size, size)
    try:
        with _worded(path, size):
            return reader, reader.start(ranges, buffers)
    except BaseException:
        reader.close()
        raise


def _made(box: _Box) -> np.ndarray:
    """A box's buffer, which `_buffer` made before any of its pieces is read."""
    if box.buffer is None:
        raise RuntimeError(f"the buffer of box {box.start}..{box.stop} was not made")
    return box.buffer


def _place(w: _Work, raw: np.ndarray) -> None:
    """Copies a piece read into `raw` (its tensor part's rows) into its box."""
    p, info = w.piece, w.info
    dtype = numpy_dtype(info.dtype).newbyteorder("<")
    strides = strides_of(info.shape, dtype.itemsize)
    part = np.ndarray(shape(p.tensor_box), dtype, raw, 0, strides)
    dst = tuple(
        slice(a - s, z - s) for (a, z), s in zip(p.leaf_box, w.box.start, strict=True)
    )
    copy(_made(w.box)[dst], to_leaf(p, part))


def _finish_done(batch, left, boxes, out) -> None:
    for w in batch:
        left[w.request.leaf] -= 1
    for w in batch:
        leaf = w.request.leaf
        if left[leaf] == 0 and leaf not in out:
            out[leaf] = _finish(w.request, boxes[leaf])


def _finish(r: Request, boxes: list[_Box]) -> Any:
    hosts = {b.start: _buffer(r, b) for b in boxes}
    if r.sharding is None:
        return next(iter(hosts.values()))
    if not boxes:
        nothing = np.broadcast_to(np.zeros((), r.dtype), r.shape)
        hosts = collections.defaultdict(lambda: nothing)
    full = r.shape
    return jax.make_array_from_callback(
        full,
        r.sharding,
        lambda index: hosts[_bounds(index, full)[0]],
        dtype=r.dtype,
    )
