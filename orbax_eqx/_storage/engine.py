"""The one ranged-read engine: arrays made of pieces of files, read, checked, put.

A unit (a numpy array, or the box devices hold of a jax array) is made of
pieces: boxes of C-order arrays in files (axes possibly permuted, length-1
axes added or dropped). Per file, ranges (widened to checksum blocks) are
merged across `File.gap`, read into 64-byte-aligned buffers and checked as
they arrive. A unit that is one run of the bytes read is a view of them (no
copy); others get a buffer of their own, filled by `PLACERS` threads.

Values a unit cannot hold are recorded on it (`refused`), not placed: a
cast's NaN, infinities or out-of-range integers (no defined result), and bool
bytes other than 0 and 1 (numpy reads 2 as True, XLA as False).
"""

import concurrent.futures
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from .._bytes import store as _store
from .._format.sidecar import PACK_ALIGNMENT
from . import ranges as _ranges

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis

# Two wanted ranges closer than this are read as one: a read call costs more
# than reading the bytes between them.
GAP = 1 << 20
# Files read in parts (shard packs, safetensors) merge across padding only:
# a process reads what its devices hold, never a neighbour's chunk.
PAD = PACK_ALIGNMENT
# Threads copying pieces into place (numpy lets go of the GIL while it
# copies): a transpose costs several times a read of the same bytes.
PLACERS = min(8, os.cpu_count() or 1)
_INLINE = 1 << 20  # smaller copies are made in this thread
TILE = 256


@dataclasses.dataclass(frozen=True, eq=False)
class File:
    """A file read from: its path, its recorded size (None: unknown), the
    error for damage found reading it (given a `BadFile`'s `what`, "is
    missing", ...), the gap across which its ranges are merged, and whether
    it must have exactly `nbytes` (else it may be shorter, if long enough for
    the ranges read), and the version it must be (`Reader.identity`; None:
    whichever is there when it is opened)."""

    path: Any
    nbytes: int | None
    damaged: Callable[[str], Exception]
    gap: int = GAP
    exact: bool = False
    identity: Any = None


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Source:
    """An array stored in C order at byte `offset` of `file`. `check`, if
    any, has `widen(first, last)` (the bytes to read for bytes `[first,
    last)` of the array), `feed(at, data)` (bytes from `at`, in order, in
    parts of at most `step`) and appends what differs to its own list."""

    file: File
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    check: Any = None


class Piece(NamedTuple):
    """Box `box` of `source` fills box `dst` of a unit (`perm`: the source's
    axes in the unit's order; None for the same)."""

    source: Source
    box: Box
    dst: Box
    perm: tuple[int, ...] | None = None


@dataclasses.dataclass(eq=False, slots=True)
class Unit:
    """A destination and its pieces; `host` once read; `refused`, the
    `(piece, Refused)` of values not placed (a list once there are any, or
    shared by the parts a large unit is read in)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: Sequence[Piece]
    host: Any = None  # (uint8 while being read)
    refused: list | None = None


class Refused(NamedTuple):
    """Values that cannot be placed: `nonfinite` NaN or infinite ones and
    `outside` ones out of the range of the integer dtype cast to, or `bools`
    bytes of a bool array other than 0 and 1."""

    nonfinite: int = 0
    outside: int = 0
    bools: int = 0

    @staticmethod
    def total(found: Sequence["Refused"]) -> "Refused":
        return Refused(*(sum(counts) for counts in zip(*found, strict=True)))

    def said(self, dtype: Any) -> str:
        """What they are, for a message (`dtype`: the one cast to)."""
        if self.bools:
            return f"{_count(self.bools, 'byte')} other than 0 and 1"
        parts = []
        if self.nonfinite:
            parts.append(f"{_count(self.nonfinite, 'NaN or infinite value')}")
        if self.outside:
            parts.append(
                f"{_count(self.outside, 'value')} outside {np.dtype(dtype)}'s "
                "range [{}, {}]".format(*_range(np.dtype(dtype)) or ("?", "?"))
            )
        return " and ".join(parts) + f", which a cast to {np.dtype(dtype)} cannot keep"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


@functools.lru_cache(maxsize=256)
def _range(dtype: np.dtype) -> tuple[int, int] | None:
    """The least and greatest value of an integer dtype (None for others)."""
    try:
        info = ml_dtypes.iinfo(dtype)
    except (TypeError, ValueError):
        return None
    return int(info.min), int(info.max)


@functools.lru_cache(maxsize=256)
def checked_cast(src: np.dtype, dst: np.dtype) -> tuple[int, int] | None:
    """The integer range a cast from `src` to `dst` must stay in (None: any
    value casts to a defined one): to an integer dtype from a float or
    complex one, or from an integer one that holds values it does not."""
    bounds, own = _range(dst), _range(src)
    if bounds is None or src == dst or src == np.bool_:
        return None
    if own is not None and bounds[0] <= own[0] and own[1] <= bounds[1]:
        return None  # every value of `src` fits
    return bounds


def cast_refused(src: np.ndarray, dtype: np.dtype) -> Refused | None:
    """What of `src` a cast to `dtype` cannot keep, or None. Costs a min and a
    max of `src` where the cast needs a check, nothing elsewhere."""
    bounds = checked_cast(src.dtype, dtype)
    if bounds is None or src.size == 0:
        return None
    x = src.real if src.dtype.kind == "c" else src  # (a cast drops the rest)
    lo, hi = bounds
    exact = int if _range(x.dtype) is not None else float
    # A float casts to an integer by dropping its fraction: defined where it
    # lies between lo - 1 and hi + 1, exclusive (NaN compares false).
    if lo - 1 < exact(x.min()) and exact(x.max()) < hi + 1:
        return None
    v = x.astype(np.float64)  # (only for the count of a refusal)
    finite = np.isfinite(v)
    t = np.trunc(v, where=finite, out=np.zeros_like(v))
    outside = np.count_nonzero((t < lo) | (t >= float(hi + 1)))
    return Refused(int(v.size - np.count_nonzero(finite)), int(outside))


def bools_refused(data: np.ndarray) -> Refused | None:
    """Bytes of a bool array's `data` other than 0 and 1, or None."""
    raw = data.view(np.uint8)
    if raw.size == 0 or raw.max() <= 1:
        return None
    return Refused(bools=int(np.count_nonzero(raw > 1)))


def values_refused(src: np.ndarray, dtype: np.dtype) -> Refused | None:
    """What of `src` cannot be placed into an array of `dtype`, or None."""
    if src.dtype == np.bool_:
        return bools_refused(src)
    return cast_refused(src, dtype)


def _refuse(unit: Unit, piece: Piece, found: Refused) -> None:
    if unit.refused is None:
        unit.refused = []
    unit.refused.append((piece, found))


@dataclasses.dataclass
class Counts:
    """What reads did: bytes read, bytes of them read to be copied (and, for
    whoever counts them, the bytes of the units)."""

    read: int = 0
    copied: int = 0
    held: int = 0


@functools.lru_cache(maxsize=4096)
def held(sharding, shape: tuple[int, ...]) -> tuple:
    """`(start, stop, devices)` of each distinct box of `sharding` on this
    process's devices (boxes held by several devices are read once)."""
    found: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=False))
        found.setdefault(box, []).append(device)
    return tuple(
        (tuple(a for a, _ in box), tuple(z for _, z in box), tuple(devices))
        for box, devices in found.items()
    )


@functools.lru_cache(maxsize=4096)
def whole(shape) -> Box:
    """The box of all of an array of `shape` (one object per shape: a restore
    makes one per leaf)."""
    return tuple((0, n) for n in shape)


def shape_of(box: Box) -> tuple[int, ...]:
    return tuple(z - a for a, z in box)


def strides_of(shape: Sequence[int], size: int) -> tuple[int, ...]:
    strides, step = [], size
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def contiguous(inner: tuple[int, ...], outer: tuple[int, ...]) -> bool:
    """Whether a box of shape `inner` inside an array of shape `outer` is one
    run of its bytes in C order (leading 1s, then one partial axis, then
    whole ones)."""
    d = 0
    while d < len(inner) and inner[d] == 1:
        d += 1
    return inner[d + 1 :] == outer[d + 1 :]


def _at(box: Box, shape, size: int) -> int:
    """Bytes into a C-order array of `shape` of the first element of `box`."""
    return sum(a * s for (a, _), s in zip(box, strides_of(shape, size), strict=True))


def span(p: Piece) -> tuple[int, int]:
    """The bytes of the file from the piece's first element to past its last."""
    s = p.source
    size = s.dtype.itemsize
    first = s.offset + _at(p.box, s.shape, size)
    if any(a >= z for a, z in p.box):
        return first, first
    ends = tuple((z - 1, z) for _, z in p.box)
    return first, s.offset + _at(ends, s.shape, size) + size


def runs(unit: Unit, p: Piece) -> bool:
    """Whether the piece is one run of bytes in its file and in the unit."""
    s = p.source
    return (
        s.dtype == unit.dtype
        and (p.perm is None or p.perm == tuple(range(len(p.perm))))
        and contiguous(shape_of(p.box), s.shape)
        and contiguous(shape_of(p.dst), unit.shape)
    )


def view_start(unit: Unit, spans) -> int | None:
    """If the unit is one run of one file's bytes, where that run starts."""
    if not unit.pieces or not all(runs(unit, p) for p in unit.pieces):
        return None
    size = unit.dtype.itemsize
    order = sorted(
        zip(unit.pieces, spans, strict=True),
        key=lambda ps: _at(ps[0].dst, unit.shape, size),
    )
    file, start = order[0][0].source.file, order[0][1][0]
    for p, (first, last) in order:
        if p.source.file is not file:
            return None
        if first - start != _at(p.dst, unit.shape, size):
            return None
    end = order[-1][1][1]
    return start if end - start == math.prod(unit.shape) * size else None


_VIEW, _DIRECT, _COPY = range(3)


class _Span(NamedTuple):
    a: int  # the bytes read, [a, z)
    z: int
    first: int  # the piece's first byte
    unit: Unit
    piece: Piece
    kind: int  # _VIEW (read into a shared buffer), _DIRECT (into the unit), _COPY
    head: bool  # the first run of a view: the unit's bytes start here


def read(
    units: Sequence[Unit],
    *,
    empty: Callable[[int], np.ndarray] = _ranges.aligned_empty,
    gap: int | None = None,
    counts: Counts | None = None,
) -> None:
    """Fills every unit's `host` (see the module's docstring); raises each
    file's `damaged` error for a file missing, short, longer than recorded,
    or replaced while read. `empty(nbytes)` makes the buffers; `gap`, if
    given, caps the files' own."""
    by_file, viewed = _spans_by_file(units)
    readers = []
    try:
        for f, spans in by_file.items():
            readers.append(_open(f, max(s.z for s in spans)))
        for u in units:  # (after opening: sizes only damage claims allocate nothing)
            if id(u) not in viewed:
                u.host = empty(math.prod(u.shape) * u.dtype.itemsize)
        with _Placers() as placers:
            for (f, spans), reader in zip(by_file.items(), readers, strict=True):
                width = f.gap if gap is None else min(f.gap, gap)
                _read_file(f, reader, spans, width, empty, placers, counts)
    finally:
        for reader in readers:
            reader.close()
    for u in units:
        if u.host is None:  # nothing to read: zero-size
            u.host = empty(0)
        u.host = u.host.view(u.dtype).reshape(u.shape)


def _spans_by_file(units: Sequence[Unit]) -> tuple[dict[File, list[_Span]], set]:
    """Each file's spans to read, and the ids of the units that are views."""
    by_file: dict[File, list[_Span]] = {}
    viewed = set()
    for u in units:
        found = [span(p) for p in u.pieces]
        start = view_start(u, found)
        if start is not None:
            viewed.add(id(u))
        for p, (first, last) in zip(u.pieces, found, strict=True):
            if first == last:
                continue
            check = p.source.check
            a, z = (first, last) if check is None else check.widen(first, last)
            if start is not None:
                kind = _VIEW
            elif (a, z) == (first, last) and runs(u, p):
                kind = _DIRECT
            else:
                kind = _COPY
            item = _Span(a, z, first, u, p, kind, first == start)
            by_file.setdefault(p.source.file, []).append(item)
    return by_file, viewed


def _open(f: File, end: int):
    """`f` opened for reads up to byte `end`: checked to be as long as
    recorded and, where `f` says which, the version reads were planned from."""
    if f.exact and f.nbytes is not None:
        end = max(end, f.nbytes)
    reader = _ranges.open_file(f.path, end, f.nbytes, f.damaged)
    if f.identity is not None and reader.identity() != f.identity:
        reader.close()
        raise f.damaged("is not the version of the file its reads were planned from")
    return reader


def _read_file(f: File, reader, spans, gap: int, empty, placers, counts) -> None:
    """Reads one file's spans, checking and placing each as it arrives."""
    ranges, buffers, walk = _layout(spans, gap, empty, counts)
    order = sorted(range(len(ranges)), key=lambda k: ranges[k])
    slot = [0] * len(ranges)
    for j, k in enumerate(order):
        slot[k] = j
    with _worded(f):
        reads = reader.start([ranges[k] for k in order], [buffers[k] for k in order])
    try:
        with _worded(f):
            known = [0] * len(ranges)
            walk.sort(key=lambda w: w[0].a)
            for s, i, at in walk:
                _arrived(s, buffers[i], at, reads, slot[i], known, placers)
            reads.wait()
    finally:
        reads.cancel()


def _layout(spans, gap: int, empty, counts):
    """One file's ranges to read (views and copies merged across `gap`),
    their buffers, and `(span, its range, where in it)` of each span."""
    ranges: list[tuple[int, int]] = []
    buffers: list[np.ndarray] = []
    walk: list[tuple[_Span, int, int]] = []
    for kind in (_VIEW, _COPY):
        mine = {k: (s.a, s.z) for k, s in enumerate(spans) if s.kind == kind}
        merged, where = _ranges.plan(mine, max_gap=gap)
        base = len(ranges)
        ranges += merged
        buffers += [empty(z - a) for a, z in merged]
        walk += [(spans[k], base + i, at) for k, (i, at) in where.items()]
        if counts is not None and kind == _COPY:
            counts.copied += sum(z - a for a, z in merged)
    for s in spans:
        if s.kind == _DIRECT:
            at = _at(s.piece.dst, s.unit.shape, s.unit.dtype.itemsize)
            ranges.append((s.a, s.z))
            buffers.append(s.unit.host[at : at + s.z - s.a])
            walk.append((s, len(ranges) - 1, 0))
    if counts is not None:
        counts.read += sum(z - a for a, z in ranges)
    return ranges, buffers, walk


def _arrived(s: _Span, buffer, at: int, reads, i: int, known, placers) -> None:
    """Checks a span once its bytes are in, and copies it into place."""
    n = s.z - s.a
    data = buffer[at : at + n]
    if s.head:
        size = math.prod(s.unit.shape) * s.unit.dtype.itemsize
        s.unit.host = buffer[at + s.first - s.a : at + s.first - s.a + size]
    source = s.piece.source
    if source.dtype == np.bool_:
        found = bools_refused(data)  # (all of it the bool array's bytes)
        if found is not None:
            _refuse(s.unit, s.piece, found)
    check = source.check
    if check is None and s.kind != _COPY:
        return
    step = n if check is None else check.step
    for k in range(0, n, step):
        stop = at + min(k + step, n)
        if stop > known[i]:
            # Asked again only past what is known, for up to 1 MiB more: not
            # once per leaf of thousands.
            known[i] = min(max(stop, known[i] + (1 << 20)), len(buffer))
            reads.ready(i, known[i])
        if check is not None:
            check.feed(s.a - s.piece.source.offset + k, data[k : k + step])
    if s.kind == _COPY:
        placers.place(s.unit, s.piece, data, s.first - s.a)


class _worded:
    """Raises a store's `BadFile` (or a file gone) as the file's own damage."""

    def __init__(self, f: File):
        self.f = f

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, tb) -> None:
        if kind is not None and issubclass(kind, _store.BadFile):
            raise self.f.damaged(error.what) from None
        if kind is not None and issubclass(kind, FileNotFoundError):
            raise self.f.damaged("is missing") from None


class _Placers:
    """Copies pieces into their units: large ones in `PLACERS` threads."""

    def __init__(self):
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._placed: list[tuple[Unit, Piece, concurrent.futures.Future]] = []

    def place(self, unit: Unit, piece: Piece, raw: np.ndarray, offset: int) -> None:
        if raw.nbytes < _INLINE:
            found = _place(unit, piece, raw, offset)
            if found is not None:
                _refuse(unit, piece, found)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(PLACERS)
        placed = self._pool.submit(_place, unit, piece, raw, offset)
        self._placed.append((unit, piece, placed))

    def __enter__(self) -> "_Placers":
        return self

    def __exit__(self, *exc) -> None:
        try:
            for unit, piece, done in self._placed:  # every copy finished first
                found = done.result()
                if found is not None:
                    _refuse(unit, piece, found)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)


def _place(unit: Unit, piece: Piece, raw: np.ndarray, offset: int) -> Refused | None:
    """Copies a piece read into `raw` (from `offset`) into its box of the
    unit, unless a cast cannot keep its values: then says what they are."""
    s = piece.source
    strides = strides_of(s.shape, s.dtype.itemsize)
    src = np.ndarray(shape_of(piece.box), s.dtype, raw, offset, strides)
    if piece.perm is not None:
        src = src.transpose(piece.perm)
    index = (*slices(piece.dst), ...)  # (a view, even of a 0-d array)
    dst = unit.host.view(unit.dtype).reshape(unit.shape)[index]
    found = cast_refused(src, unit.dtype)
    if found is None:
        _copy(dst, src.reshape(dst.shape))
    return found


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, z) for a, z in box)


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` (numpy casts where dtypes differ), in tiles of the last
    two axes where `src` is transposed there: a tile's reads and writes stay
    in cache."""
    if (
        src.ndim < 2
        or src.strides[-1] == src.itemsize
        or src.shape[-1] * src.shape[-2] <= TILE * TILE
    ):
        dst[...] = src
        return
    rows, cols = src.shape[-2:]
    for i in range(0, rows, TILE):
        for j in range(0, cols, TILE):
            dst[..., i : i + TILE, j : j + TILE] = src[..., i : i + TILE, j : j + TILE]
