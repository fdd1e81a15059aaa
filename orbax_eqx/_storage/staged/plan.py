"""What a staged restore reads, and in which jobs (see `staged.read`).

A packed leaf is one unit (read whole, for the checksum of all its bytes); a
shard-packed leaf has a unit per distinct box of its target sharding on this
process's devices. A unit costs what it stages: the bytes read (widened to
whole checksum blocks of their chunk for checked shard-pack reads, 64 bytes of
slack each), the
boxes assembled from them where a box is not one contiguous range of what
was read, and their casts (`cast=True`). Units are grouped in jobs of at most
`Staging.job_bytes`; a unit that costs more is a job of its own, or, past
`limit`, cut into slabs (see `streaming.slabs`), a job each.
"""

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from etils import epath

from ..._format.sidecar import PACK_ALIGNMENT, PACKED, Metadata, itemsize, shard_file
from ..._tree.walk import JAX, is_key_dtype, key_data_struct, parse_dtype
from .. import ranges as _ranges
from ..boxes import Target, contiguous, geometry, strides_of, target
from ..sharded.index import MAX_BLOCK, Chunk, widen
from ..sharded.index_read import read_all, token_of
from ..transfer import streaming

# The least a streamed slab of a shard pack may stage: its bytes, plus up to
# two checksum blocks (at most `MAX_BLOCK` each) read only to check them. Half of
# `staging.MIN_WINDOW`.
SLAB_FLOOR = 4 * MAX_BLOCK


@dataclasses.dataclass(eq=False, slots=True)
class Leaf:
    """A leaf being restored: where its bytes are, where they go, what arrived."""

    name: str
    request: Any
    shape: tuple[int, ...]  # the stored array's, without key data's own axes
    tail: tuple[int, ...]  # key data's own axes (() for other dtypes)
    elem: np.dtype  # the stored element type (key data's for keys)
    dtype: np.dtype  # the element type wanted (differs with `cast=True`)
    size: int  # bytes per stored element, key data's axes included
    paths: list[epath.Path]  # per chunk, its file
    chunks: list[Any]  # shard-pack chunks in box order; one for a packed leaf
    targets: tuple[Target, ...]
    packed: bool
    left: int = 0  # units still to arrive
    crc: Any = None  # `checksum.Running` of a streamed packed leaf's bytes...
    summed: int = 0  # ... which are its first `summed` bytes
    # What is on devices: {None: the whole array} or {(box, device): its part}.
    on_device: dict | None = None
    result: Any = None  # the whole array, once made

    @property
    def direct(self) -> bool:
        """Put whole with its own sharding (one box, all of it here)."""
        sharding = self.request.sharding
        return len(self.targets) == 1 and sharding.is_fully_addressable

    def box_bytes(self, shape) -> int:
        return math.prod(shape) * self.size

    def cast_bytes(self, shape) -> int:
        if self.dtype == self.elem:
            return 0
        return math.prod(shape) * math.prod(self.tail) * self.dtype.itemsize


def leaves(directory, saved: Metadata, requests: dict[str, Any]) -> list[Leaf]:
    """The leaves of `requests` (packed ones first, in file order), each with
    its chunks and target boxes; pack files checked to be regular files of
    the size recorded, long enough for the leaves."""
    chunks: dict[str, list[Chunk]] | None = None
    packs = [[directory / pack.file] for pack in saved.packs]  # shared by leaves
    shard_files: dict[int, epath.Path] = {}
    packed: list[Leaf] = []
    sharded: list[Leaf] = []
    for name, request in requests.items():
        record = request.record
        elem, tail, size, key = stored_type(record.dtype)
        shape = tuple(record.shape)
        sharding = request.sharding if request.container == JAX else None
        ordered: list[Any]
        boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
        if record.data == PACKED:
            paths = packs[record.pack]
            ordered = _ONE_CHUNK
            boxes = ((tuple(0 for _ in shape), shape),)
        else:
            if chunks is None:
                chunks = read_all(directory, saved)  # checks every index first
            ordered = sorted(chunks[name], key=lambda c: c.start)
            paths = []
            for c in ordered:
                path = shard_files.get(c.process)
                if path is None:
                    path = directory / shard_file(token_of(saved), c.process)
                    shard_files[c.process] = path
                paths.append(path)
            boxes = tuple((c.start, c.stop) for c in ordered)
        leaf = Leaf(
            name,
            request,
            shape,
            tail,
            elem,
            elem if key else np.dtype(request.dtype),
            size,
            paths,
            ordered,
            geometry(shape, size, boxes, sharding),
            record.data == PACKED,
        )
        (packed if leaf.packed else sharded).append(leaf)
    packed.sort(key=lambda leaf: (leaf.request.record.pack, leaf.request.record.offset))
    ends: dict[int, int] = {}
    for leaf in packed:
        record = leaf.request.record
        ends[record.pack] = max(ends.get(record.pack, 0), record.offset + record.nbytes)
    for pack, end in ends.items():
        # Now, before slabs are planned for sizes only a damaged sidecar claims.
        _ranges.check_size(packs[pack][0], end, saved.packs[pack].nbytes)
    return packed + sharded


_ONE_CHUNK = [None]  # a packed leaf's: the whole array, in the pack file


@functools.cache
def stored_type(text: str):
    """`(element dtype, key data's own axes, bytes per element, is a key)` of
    arrays stored with the dtype named `text`."""
    saved = parse_dtype(text)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        return np.dtype(data.dtype), tuple(data.shape), itemsize(saved), True
    return np.dtype(saved), (), itemsize(saved), False


@dataclasses.dataclass
class Step:
    """Part of a job: a packed leaf (`box` None) or one box of a shard-packed
    leaf, whole (`slab` None) or one slab of it (global start and shape)."""

    leaf: Leaf
    box: int | None
    slab: streaming.Box | None = None
    last: bool = True  # the unit is complete after this step

    @property
    def index(self) -> int:
        """`box`, for a step of a shard-packed leaf (which always has one)."""
        if self.box is None:
            raise ValueError(f"a step of packed leaf {self.leaf.name} has no box")
        return self.box


class Plan:
    """Costs, jobs and slabs of units, for reads checked (`verify`) or not."""

    def __init__(self, verify: bool):
        self.verify = verify

    def jobs(self, leaves: list[Leaf], budget: int, staging) -> Iterator[list[Step]]:
        """The steps of each job, in order; counts slabs in `staging.parts`."""
        steps: list[Step] = []
        cost = 0
        for leaf in leaves:
            units = [None] if leaf.packed else range(len(leaf.targets))
            leaf.left = len(units)
            for box in units:
                step = Step(leaf, box)
                c = self.cost(step)
                if c <= budget:
                    if steps and cost + c > budget:
                        yield steps
                        steps, cost = [], 0
                    steps.append(step)
                    cost += c
                    continue
                if steps:
                    yield steps
                    steps, cost = [], 0
                limit = self.limit(leaf, budget)
                if c <= limit:  # a job of its own
                    yield [step]
                    continue
                for part in self.slabs(step, limit):
                    staging.parts += 1
                    yield [part]
        if steps:
            yield steps

    def limit(self, leaf: Leaf, budget: int) -> int:
        """The most a job of one unit of `leaf`, or one slab of it, stages."""
        if leaf.packed or not self.verify:
            return budget
        # Checked reads are whole blocks (up to 1 MiB): a slab of a chunk may
        # read two more than it needs, however thin it is cut.
        return max(budget, SLAB_FLOOR)

    def slabs(self, step: Step, budget: int) -> list[Step]:
        leaf = step.leaf
        if leaf.packed:
            start, shape = (0,) * len(leaf.shape), leaf.shape
        else:
            t = leaf.targets[step.index]
            start, shape = t.start, t.shape

        def cost(slab):
            return self.cost(Step(leaf, step.box, slab))

        cut = streaming.slabs(start, shape, budget, cost)
        return [
            Step(leaf, step.box, slab, last=i == len(cut) - 1)
            for i, slab in enumerate(cut)
        ]

    def cost(self, step: Step) -> int:
        """The most bytes `step` stages: reads, boxes assembled, casts."""
        leaf = step.leaf
        if leaf.packed:
            shape = step.slab[1] if step.slab else leaf.shape
            cost = leaf.box_bytes(shape) + PACK_ALIGNMENT
            for _, local, isect in self.parts(step):
                if not contiguous(isect, shape):
                    cost += leaf.box_bytes(isect)
                cost += leaf.cast_bytes(isect)
            return cost
        t = self.target(step)
        cost = sum(z - a + PACK_ALIGNMENT for _, a, z in self.spans(step, t))
        if not self.viewable(leaf, t):
            cost += leaf.box_bytes(t.shape)
        return cost + leaf.cast_bytes(t.shape)

    def target(self, step: Step) -> Target:
        """The box of a shard-packed leaf's step, with its pieces."""
        leaf = step.leaf
        t = leaf.targets[step.index]
        if step.slab is None:
            return t
        start, shape = step.slab
        stop = tuple(a + n for a, n in zip(start, shape, strict=True))
        boxes = tuple((c.start, c.stop) for c in leaf.chunks)
        return target(start, stop, boxes, leaf.size)

    def spans(self, step: Step, t: Target):
        """`(chunk index, first byte, end byte)` read of each piece of `t`."""
        out = []
        for p in t.pieces:
            a, z = p.first, p.last
            if self.verify:
                a, z = widen(step.leaf.chunks[p.k], a, z)
            out.append((p.k, a, z))
        return out

    @staticmethod
    def viewable(leaf: Leaf, t: Target) -> bool:
        if len(t.pieces) != 1:
            return False
        chunk = leaf.chunks[t.pieces[0].k]
        return contiguous(t.pieces[0].shape, chunk.shape)

    def parts(self, step: Step):
        """For a packed leaf's step: `(box, start in the slab, shape)` of each
        target box's overlap with what the step reads."""
        leaf = step.leaf
        if step.slab is None:
            return [(i, t.start, t.shape) for i, t in enumerate(leaf.targets)]
        s_start, s_shape = step.slab
        out = []
        for i, t in enumerate(leaf.targets):
            lo = tuple(max(a, b) for a, b in zip(s_start, t.start, strict=True))
            hi = tuple(
                min(a + n, b + m)
                for a, n, b, m in zip(s_start, s_shape, t.start, t.shape, strict=True)
            )
            if all(x < y for x, y in zip(lo, hi, strict=True)):
                local = tuple(x - a for x, a in zip(lo, s_start, strict=True))
                out.append(
                    (i, local, tuple(y - x for x, y in zip(lo, hi, strict=True)))
                )
        return out


def offset(start, shape, size: int) -> int:
    """Bytes into a C-order array of `shape` of the element at `start`."""
    return sum(a * s for a, s in zip(start, strides_of(shape, size), strict=True))
