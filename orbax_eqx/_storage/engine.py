"""The one ranged-read engine: arrays made of pieces of files, read, checked, put.

A unit is a destination: a whole numpy array, or the box that devices hold
of a jax array. It is made of pieces, each a box of an array stored in C
order in a file (a packed leaf, a chunk of a shard pack, a safetensors
tensor) and the box of the unit it fills (its axes possibly permuted, axes
of length 1 added or dropped: the state_dict bridge's stacks and
transposes).

`read` fills a batch of units. Per file, the byte ranges of the pieces
(widened to whole checksum blocks where the format records them) are merged
across small gaps (`File.gap`) and read through `_bytes` (threaded `preadv`
on a disk, ranged GETs on an object store) into 64-byte-aligned buffers;
each range is checked as its bytes arrive. A unit whose pieces are one run
of the bytes read, in its own order, is a view of them (a packed leaf, a
chunk onto its saving mesh, whole chunks stacked along the first axis): no
copy, and on CPU `jax.device_put` takes it as it is. Any other unit gets a
buffer of its own: a piece that is one run of bytes on both sides is read
straight into its place (a layer of a stacked leaf), any other (a column
strip, a transpose, a cast) into a buffer of its own and copied in, by
`PLACERS` threads, as its bytes arrive.

`arrays` makes the arrays. On CPU, the buffers as they are, in batches of
a bounded size; where transfers copy (accelerators, `ORBAX_EQX_STAGING=copy`)
through the staging window, in jobs of a bounded cost (`transfer.staging`),
a unit larger than a job streamed into its device buffer in slabs
(`transfer.streaming`). No computation runs over a sharded array, and no
process waits for another.
"""

import concurrent.futures
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._bytes import store as _store
from .._format.sidecar import PACK_ALIGNMENT
from . import ranges as _ranges
from .transfer import streaming
from .transfer.staging import Job, Staging

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis

# Two wanted ranges closer than this are read as one: a read call costs more
# than reading the bytes between them.
GAP = 1 << 20
# Files read in parts (shard packs, safetensors) merge across padding only:
# a process reads what its devices hold, never a neighbour's chunk.
PAD = PACK_ALIGNMENT
DEFAULT_WINDOW = 1 << 30  # bytes read per batch at most, on CPU
# Bytes read only to be copied in, per batch (transient): at most an eighth
# of what the units hold, between these. Measured on 16 cores (GPT-2's 1.32
# GiB, 1.21 GB of it transposed): with 64 MiB reads waited on the copies.
COPY_WINDOW = 256 << 20
MIN_COPY_WINDOW = 1 << 20
PIECES = 4096  # pieces per batch at most (a few hundred bytes of bookkeeping each)
# Threads copying pieces into place (numpy lets go of the GIL while it
# copies): a transpose costs several times a read of the same bytes.
PLACERS = min(8, os.cpu_count() or 1)
_INLINE = 1 << 20  # smaller copies are made in this thread
_PUT_BATCH = 4096  # arrays per `jax.device_put` call
TILE = 256


@dataclasses.dataclass(frozen=True, eq=False)
class File:
    """A file read from: its path, its recorded size (None: unknown), the
    error for damage found reading it (given a `BadFile`'s `what`, "is
    missing", ...), the gap across which its ranges are merged, and whether
    it must have exactly `nbytes` (else it may be shorter, if long enough for
    the ranges read)."""

    path: Any
    nbytes: int | None
    damaged: Callable[[str], Exception]
    gap: int = GAP
    exact: bool = False


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
    """A destination and its pieces; `host` once read."""

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: list[Piece]
    host: Any = None  # (uint8 while being read)


@dataclasses.dataclass(eq=False)
class Leaf:
    """An array to make from units: `units` are `(box start, devices, unit)`
    (the start on the first `ndim` axes; a typed PRNG key's own axes are
    whole); `sharding` None for a numpy array (one unit, the whole array);
    `wrap` makes the result from the array (typed PRNG keys)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    units: list[tuple[tuple[int, ...], tuple, Unit]]
    ndim: int
    wrap: Callable[[Any], Any] | None = None
    result: Any = None
    parts: dict = dataclasses.field(default_factory=dict)  # staged: on devices
    left: int = 0  # staged: units still to arrive


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


def whole(shape) -> Box:
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


def _span(p: Piece) -> tuple[int, int]:
    """The bytes of the file from the piece's first element to past its last."""
    s = p.source
    size = s.dtype.itemsize
    first = s.offset + _at(p.box, s.shape, size)
    if any(a >= z for a, z in p.box):
        return first, first
    ends = tuple((z - 1, z) for _, z in p.box)
    return first, s.offset + _at(ends, s.shape, size) + size


def _runs(unit: Unit, p: Piece) -> bool:
    """Whether the piece is one run of bytes in its file and in the unit."""
    s = p.source
    return (
        s.dtype == unit.dtype
        and (p.perm is None or p.perm == tuple(range(len(p.perm))))
        and contiguous(shape_of(p.box), s.shape)
        and contiguous(shape_of(p.dst), unit.shape)
    )


def _view(unit: Unit, spans) -> int | None:
    """If the unit is one run of one file's bytes, where that run starts."""
    if not unit.pieces or not all(_runs(unit, p) for p in unit.pieces):
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
    by_file: dict[File, list[_Span]] = {}
    viewed = set()
    for u in units:
        found = [_span(p) for p in u.pieces]
        start = _view(u, found)
        if start is not None:
            viewed.add(id(u))
        for p, (first, last) in zip(u.pieces, found, strict=True):
            if first == last:
                continue
            check = p.source.check
            a, z = (first, last) if check is None else check.widen(first, last)
            if start is not None:
                kind = _VIEW
            elif (a, z) == (first, last) and _runs(u, p):
                kind = _DIRECT
            else:
                kind = _COPY
            span = _Span(a, z, first, u, p, kind, first == start)
            by_file.setdefault(p.source.file, []).append(span)
    readers = []
    try:
        for f, spans in by_file.items():
            end = max(s.z for s in spans)
            if f.exact and f.nbytes is not None:
                end = max(end, f.nbytes)
            readers.append(_ranges.open_file(f.path, end, f.nbytes, f.damaged))
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


def _read_file(f: File, reader, spans, gap: int, empty, placers, counts) -> None:
    """Reads one file's spans, checking and placing each as it arrives."""
    ranges: list[tuple[int, int]] = []
    buffers: list[np.ndarray] = []
    walk: list[tuple[_Span, int, int]] = []  # (span, its range, where in it)
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


def _arrived(s: _Span, buffer, at: int, reads, i: int, known, placers) -> None:
    """Checks a span once its bytes are in, and copies it into place."""
    n = s.z - s.a
    data = buffer[at : at + n]
    if s.head:
        size = math.prod(s.unit.shape) * s.unit.dtype.itemsize
        s.unit.host = buffer[at + s.first - s.a : at + s.first - s.a + size]
    check = s.piece.source.check
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
        self._placed: list[concurrent.futures.Future] = []

    def place(self, unit: Unit, piece: Piece, raw: np.ndarray, offset: int) -> None:
        if raw.nbytes < _INLINE:
            _place(unit, piece, raw, offset)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(PLACERS)
        self._placed.append(self._pool.submit(_place, unit, piece, raw, offset))

    def __enter__(self) -> "_Placers":
        return self

    def __exit__(self, *exc) -> None:
        try:
            for done in self._placed:  # every copy finished before going on
                done.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)


def _place(unit: Unit, piece: Piece, raw: np.ndarray, offset: int) -> None:
    """Copies a piece read into `raw` (from `offset`) into its box of the unit."""
    s = piece.source
    strides = strides_of(s.shape, s.dtype.itemsize)
    src = np.ndarray(shape_of(piece.box), s.dtype, raw, offset, strides)
    if piece.perm is not None:
        src = src.transpose(piece.perm)
    index = (*_slices(piece.dst), ...)  # (a view, even of a 0-d array)
    dst = unit.host.view(unit.dtype).reshape(unit.shape)[index]
    _copy(dst, src.reshape(dst.shape))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, z) for a, z in box)


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[...] = src` (numpy casts where dtypes differ), in tiles of the last
    two axes where `src` is transposed there: a tile's reads and writes stay
    in cache (measured: 1.4x as fast as numpy's own strided copy of a
    (1024, 4096) float32 transpose)."""
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


def arrays(
    leaves: Sequence[Leaf],
    staging: Staging | None = None,
    *,
    window: int = DEFAULT_WINDOW,
    counts: Counts | None = None,
    advance: Callable[[int], None] | None = None,
) -> list[Any]:
    """Reads the leaves' units and makes each leaf's array (see the module's
    docstring); returns them in order. `advance(nbytes)` is told the bytes of
    each batch once it is read."""
    if staging is not None and staging.copy:
        _staged(leaves, staging)
        return [leaf.result for leaf in leaves]
    units = [u for leaf in leaves for _, _, u in leaf.units]
    held = sum(math.prod(u.shape) * u.dtype.itemsize for u in units)
    copy_window = min(COPY_WINDOW, max(MIN_COPY_WINDOW, held // 8))
    batch: list[Unit] = []
    staged = copied = pieces = 0
    for u in sorted(units, key=_file_order):
        full = staged >= window or copied >= copy_window or pieces >= PIECES
        # Never between units of one tensor (a fused qkv): its bytes once.
        if full and not _shared(batch[-1], u):
            _read_batch(batch, staged, counts, advance)
            batch, staged, copied, pieces = [], 0, 0, 0
        batch.append(u)
        found = [_span(p) for p in u.pieces]
        nbytes = sum(last - first for first, last in found)
        staged += nbytes
        copied += 0 if _view(u, found) is not None else nbytes
        pieces += len(u.pieces)
    if batch:
        _read_batch(batch, staged, counts, advance)
    _made(leaves)
    return [leaf.result for leaf in leaves]


def _file_order(u: Unit):
    """Units in the order of their first bytes: a disk reads forward, and a
    tensor that several units need (a fused qkv) is read once in a batch."""
    if not u.pieces:
        return ("", 0)
    p = u.pieces[0]
    return (str(p.source.file.path), p.source.offset)


def _shared(a: Unit, b: Unit) -> bool:
    """Whether units `a` and `b` read the same stored array."""
    mine = {id(p.source) for p in a.pieces}
    return any(id(p.source) in mine for p in b.pieces)


def _read_batch(batch, nbytes: int, counts, advance) -> None:
    read(batch, counts=counts)
    if advance is not None:
        advance(nbytes)


def _whole(leaf: Leaf) -> Unit | None:
    """The leaf's one unit, if it is the whole array put with the leaf's
    sharding (devices None: a packed leaf onto a sharded target)."""
    if len(leaf.units) != 1:
        return None
    _, devices, u = leaf.units[0]
    return u if devices is None or u.shape == leaf.shape else None


def _made(leaves: Sequence[Leaf]) -> None:
    """Each leaf's array from its units' hosts, as they are (CPU)."""
    # One `device_put` per sharding costs far less per array than one per
    # array; each sharding object is looked at once (by `id`: hashing one
    # costs more, per leaf, than the rest of this loop).
    batches: dict[int, tuple[Any, list[Leaf]]] = {}
    for leaf in leaves:
        u = _whole(leaf)
        if leaf.sharding is None:
            leaf.result = leaf.units[0][2].host
        elif u is not None and _addressable(leaf.sharding):
            batches.setdefault(id(leaf.sharding), (leaf.sharding, []))[1].append(leaf)
        else:
            leaf.result = _from_callback(leaf)
    for sharding, group in batches.values():
        for at in range(0, len(group), _PUT_BATCH):
            part = group[at : at + _PUT_BATCH]
            hosts = [leaf.units[0][2].host for leaf in part]
            for leaf, array in zip(part, jax.device_put(hosts, sharding), strict=True):
                leaf.result = array
    for leaf in leaves:
        if leaf.wrap is not None:
            leaf.result = leaf.wrap(leaf.result)


_ADDRESSABLE: dict[Any, bool] = {}


def _addressable(sharding) -> bool:
    found = _ADDRESSABLE.get(sharding)
    if found is None:  # (JAX computes it each time)
        found = _ADDRESSABLE[sharding] = sharding.is_fully_addressable
        if len(_ADDRESSABLE) > 4096:
            _ADDRESSABLE.clear()
    return found


def _from_callback(leaf: Leaf, handoff=None) -> jax.Array:
    """The array made with one batched transfer of every device's box. With
    no box here JAX needs the dtype (it has no data to take it from)."""
    u = _whole(leaf)
    hosts = {start: unit.host for start, _, unit in leaf.units}
    nothing = np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)

    def part(index):
        if u is not None:
            found = u.host[index]
        else:
            found = hosts.get(start_of(index, leaf.shape[: leaf.ndim]), nothing)
        return found if handoff is None else handoff(found)

    return jax.make_array_from_callback(
        leaf.shape, leaf.sharding, part, dtype=leaf.dtype
    )


def start_of(index, shape) -> tuple[int, ...]:
    """The first element of a device's box, from the index JAX gives (key
    data's own axes left out)."""
    start = tuple(s.start or 0 for s in index[: len(shape)])
    if min(start, default=0) < 0:
        start = tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=False))
    return start


# The least a streamed slab may stage where reads are widened to whole
# checksum blocks (up to 1 MiB each, two more than a slab needs).
SLAB_FLOOR = 4 << 20


class _Step(NamedTuple):
    """Part of a staged job: a unit of a leaf, or a slab of it (`at` its
    start in the unit; `last` whether the unit is complete after it)."""

    leaf: Leaf
    start: tuple[int, ...]
    devices: tuple | None
    unit: Unit
    at: tuple[int, ...] | None = None
    last: bool = True
    full: tuple[int, ...] = ()  # the unit's shape, for a slab


def _cost(u: Unit) -> int:
    """The most bytes reading `u` stages: its reads and its own buffer."""
    found = [_span(p) for p in u.pieces]
    spans = [
        (first, last) if p.source.check is None else p.source.check.widen(first, last)
        for p, (first, last) in zip(u.pieces, found, strict=True)
    ]
    if _view(u, found) is not None:
        return sum(z - a + PAD for a, z in spans)
    own = math.prod(u.shape) * u.dtype.itemsize + PAD
    return own + sum(
        z - a + PAD
        for p, (a, z), f in zip(u.pieces, spans, found, strict=True)
        if (a, z) != f or not _runs(u, p)
    )


def _cuttable(u: Unit) -> bool:
    """Whether every piece of `u` can be cut along the unit's axes."""
    return all(p.perm is None and len(p.box) == len(p.dst) for p in u.pieces)


def _clip(u: Unit, start, shape) -> Unit:
    """The part of `u` (`_cuttable`) in its box `(start, shape)`."""
    pieces = []
    for p in u.pieces:
        box, dst = [], []
        for (a, _), (c, d), s, n in zip(p.box, p.dst, start, shape, strict=True):
            lo, hi = max(c, s), min(d, s + n)
            if lo >= hi:
                break
            box.append((a + lo - c, a + hi - c))
            dst.append((lo - s, hi - s))
        else:
            pieces.append(p._replace(box=tuple(box), dst=tuple(dst)))
    return Unit(tuple(shape), u.dtype, pieces)


def _jobs(leaves: Sequence[Leaf], budget: int, staging: Staging):
    """The steps of each staged job, in order; counts slabs in `staging.parts`."""
    steps: list[_Step] = []
    cost = 0
    for leaf in leaves:
        leaf.left = len(leaf.units)
        for start, devices, u in leaf.units:
            c = _cost(u)
            if c <= budget:
                if steps and cost + c > budget:
                    yield steps
                    steps, cost = [], 0
                steps.append(_Step(leaf, start, devices, u))
                cost += c
                continue
            if steps:
                yield steps
                steps, cost = [], 0
            widened = any(
                p.source.check is not None and p.source.check.widens for p in u.pieces
            )
            limit = max(budget, SLAB_FLOOR) if widened else budget
            # Slabs go to devices that hold the whole unit, or into a numpy leaf.
            whole_here = devices is not None or leaf.sharding is None
            if c <= limit or not whole_here or not _cuttable(u):
                yield [_Step(leaf, start, devices, u)]  # a job of its own
                continue
            cut = streaming.slabs(
                (0,) * len(u.shape), u.shape, limit, lambda b: _cost(_clip(u, *b))
            )
            for i, (at, shape) in enumerate(cut):
                staging.parts += 1
                part = _clip(u, at, shape)
                yield [
                    _Step(leaf, start, devices, part, at, i == len(cut) - 1, u.shape)
                ]
    if steps:
        yield steps


def _staged(leaves: Sequence[Leaf], staging: Staging) -> None:
    total = sum(
        math.prod(u.shape) * u.dtype.itemsize
        for leaf in leaves
        for _, _, u in leaf.units
    )
    budget = staging.job_bytes(total)

    def job(steps: list[_Step]) -> Job:
        def fill():
            read([s.unit for s in steps], empty=staging.empty, gap=PAD)
            return steps

        return Job(fill, lambda done: _put(done, staging))

    for leaf in leaves:
        leaf.left = len(leaf.units)
    staging.run(job(steps) for steps in _jobs(leaves, budget, staging))
    for leaf in leaves:
        if leaf.result is None:  # no box of it is on this process's devices
            _finish(leaf)


def _put(steps: list[_Step], staging: Staging) -> list[jax.Array]:
    """Starts the transfers of a job's hosts; returns what to wait for."""
    xs, shardings, sinks = [], [], []
    for s in steps:
        leaf, host = s.leaf, s.unit.host
        if leaf.sharding is None:  # numpy: copied out of the staging buffers
            if s.at is None:
                leaf.result = np.array(host, copy=True)
                continue
            if leaf.result is None:
                leaf.result = np.empty(leaf.shape, leaf.dtype)
            at = tuple(zip(s.at, s.unit.shape, strict=True))
            leaf.result[tuple(slice(a, a + n) for a, n in at)] = host
        elif s.at is None and _whole(leaf) is not None:
            if _addressable(leaf.sharding):
                xs.append(staging.handoff(host))
                shardings.append(leaf.sharding)
                sinks.append((s, None))
            else:
                leaf.result = _from_callback(leaf, staging.handoff)
        else:
            for device in s.devices or ():
                xs.append(staging.handoff(host))
                shardings.append(_single(device))
                sinks.append((s, device))
    placed = jax.device_put(xs, shardings) if xs else []
    del xs
    for s in steps:  # the staging buffers go once their transfers are done
        s.unit.host = None
    started = []
    for (s, device), array in zip(sinks, placed, strict=True):
        parts = s.leaf.parts
        key = None if device is None else (s.start, device)
        if s.at is not None:
            buffer = parts.get(key)
            if buffer is None:
                buffer = streaming.zeros(s.full, array.dtype, device)
            array = streaming.update(buffer, array, s.at)
        parts[key] = array
        started.append(array)
    for s in steps:
        if s.last:
            s.leaf.left -= 1
            if s.leaf.left == 0 and s.leaf.result is None:
                _finish(s.leaf)
    return started


def _finish(leaf: Leaf) -> None:
    parts, leaf.parts = leaf.parts, {}
    if leaf.sharding is not None:
        if None in parts:
            leaf.result = parts[None]
        else:
            # With no part here, JAX needs the dtype (it has no data to take it from).
            leaf.result = jax.make_array_from_single_device_arrays(
                leaf.shape, leaf.sharding, list(parts.values()), dtype=leaf.dtype
            )
    if leaf.wrap is not None:
        leaf.result = leaf.wrap(leaf.result)


_SINGLE: dict = {}


def _single(device) -> jax.sharding.SingleDeviceSharding:
    found = _SINGLE.get(device)
    if found is None:
        found = _SINGLE[device] = jax.sharding.SingleDeviceSharding(device)
    return found
