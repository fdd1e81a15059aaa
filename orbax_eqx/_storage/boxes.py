"""Boxes of arrays in C order: what the layouts that read parts of arrays share.

A box is `(start, stop)` (or `(start, shape)`) in an array's global
coordinates. A target box (what one device holds of a target sharding) is
made of the stored boxes it overlaps (`target`, `geometry`): of each, the
byte range from the overlap's first element to its last, and where it lies in
the target. Shard packs, the staged restore and the state_dict bridge's
reads all work this way.
"""

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One stored chunk's overlap with one target box."""

    k: int  # the chunk's place in its leaf's chunks, sorted by box
    dst: tuple[slice, ...]  # where the overlap lies in the box
    first: int  # bytes into the chunk of the overlap's first element
    last: int  # ... and just past its last
    shape: tuple[int, ...]  # the overlap's shape
    strides: tuple[int, ...]  # the chunk's strides, in bytes


@dataclasses.dataclass(frozen=True)
class Target:
    """One distinct box of the target sharding, and the devices that hold it."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    devices: tuple[Any, ...]  # () for a numpy leaf: one box, the whole array
    pieces: tuple[_Piece, ...]
    whole: bool  # one piece, which is its whole chunk: no copy needed
    # Whole chunks stacked along the first dimension, in order: no copy
    # needed either where they were stored and read one after the other.
    stacked: bool
    # One piece, a contiguous range of its chunk: a view of what is read.
    contiguous: bool = False

    @property
    def viewed(self) -> bool:
        """Whether the box is (usually) a view of the bytes read, not a copy."""
        return self.whole or self.stacked or self.contiguous


_GEOMETRY: dict = {}


def geometry(shape, size: int, boxes: tuple, sharding) -> tuple[Target, ...]:
    """The target boxes of a leaf and how each is made of its stored chunks.

    Worked out once per (shape, item size, chunk boxes, target sharding):
    the leaves of a deep model share a few layouts.
    """
    key = (shape, size, boxes, sharding)
    found = _GEOMETRY.get(key)
    if found is None:
        found = _work_out(shape, size, boxes, sharding)
        if len(_GEOMETRY) > 4096:
            _GEOMETRY.clear()
        _GEOMETRY[key] = found
    return found


def _work_out(shape, size, boxes, sharding) -> tuple[Target, ...]:
    wanted: dict[tuple, list] = {}  # (start, stop) -> devices
    if sharding is None:
        wanted[((0,) * len(shape), shape)] = []
    else:
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            wanted.setdefault(box(index, shape), []).append(device)
    grid = _grid(boxes, len(shape))
    return tuple(
        target(start, stop, boxes, size, tuple(devices), grid)
        for (start, stop), devices in wanted.items()
    )


def _grid(boxes, ndim: int):
    """The chunks as a grid: per dimension, sorted cuts; a chunk by its start."""
    cuts = [sorted({(a[d], b[d]) for a, b in boxes}) for d in range(ndim)]
    return cuts, {a: k for k, (a, _) in enumerate(boxes)}


def target(start, stop, boxes, size: int, devices=(), grid=None) -> Target:
    """The box `[start, stop)` and how it is made of the chunks `boxes` (each
    `(start, stop)`) of an array of `size`-byte elements."""
    cuts, at = grid or _grid(boxes, len(start))
    spans = []
    for d, (lo, hi) in enumerate(zip(start, stop, strict=True)):
        ends = [b for _, b in cuts[d]]
        i = bisect.bisect_right(ends, lo)
        spans.append([c for c in cuts[d][i:] if c[0] < hi])
    pieces = []
    for cell in itertools.product(*spans):
        k = at[tuple(a for a, _ in cell)]
        c_start, c_stop = boxes[k]
        lo = tuple(max(a, s) for a, s in zip(start, c_start, strict=True))
        hi = tuple(min(a, s) for a, s in zip(stop, c_stop, strict=True))
        strides = strides_of(_shape(c_start, c_stop), size)
        first = sum((x - s) * st for x, s, st in zip(lo, c_start, strides, strict=True))
        last = sum(
            (y - 1 - s) * st for y, s, st in zip(hi, c_start, strides, strict=True)
        )
        dst = tuple(slice(x - s, y - s) for x, y, s in zip(lo, hi, start, strict=True))
        pieces.append(_Piece(k, dst, first, last + size, _shape(lo, hi), strides))
    whole = len(pieces) == 1 and boxes[pieces[0].k] == (start, stop)
    one_range = len(pieces) == 1 and contiguous(
        pieces[0].shape, _shape(*boxes[pieces[0].k])
    )
    shape = _shape(start, stop)
    full = tuple(slice(0, n) for n in shape[1:])
    stacked = (
        len(pieces) > 1
        and all(  # in order: `spans` are sorted
            p.shape == _shape(*boxes[p.k]) and p.dst[1:] == full for p in pieces
        )
    )
    return Target(start, shape, devices, tuple(pieces), whole, stacked, one_range)


def box(index: tuple[slice, ...], shape: Sequence[int]):
    """`(start, stop)` of a shard's index (a tuple of slices) in `shape`."""
    start, stop = [], []
    for s, n in zip(index, shape, strict=False):
        a, b, _ = s.indices(n)
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


def start_of(index, shape) -> tuple[int, ...]:
    """The first element of a device's box, from the index JAX gives (key
    data's own axes left out). Its slices' starts are None or not negative;
    anything else takes the long way."""
    start = tuple(s.start or 0 for s in index[: len(shape)])
    if min(start, default=0) < 0:
        start = box(index[: len(shape)], shape)[0]
    return start


def _shape(start, stop) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(start, stop, strict=True))


def strides_of(shape: Sequence[int], size: int) -> tuple[int, ...]:
    strides, step = [], size
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def contiguous(inner: tuple[int, ...], outer: tuple[int, ...]) -> bool:
    """Whether a box of shape `inner` inside an array of shape `outer` is one
    contiguous range of its bytes in C order (leading 1s, then one partial
    axis, then whole ones)."""
    d = 0
    while d < len(inner) and inner[d] == 1:
        d += 1
    return inner[d + 1 :] == outer[d + 1 :]
