"""Packed and shard-packed leaves read through a staging window (see `staging`).

Used where transfers copy (accelerators, or `ORBAX_EQX_STAGING=copy`); on CPU
`packing.read` and `shard_read.read` hand their buffers to the devices as
they are. Both kinds of leaf are read the same way here: a packed leaf is a
leaf of one chunk, the whole array, at its offset in the pack file, checked
against the CRC-32 of all its bytes; a shard-packed leaf has the chunks of
its index, checked per 1 MiB block (reads are widened to whole blocks).

The unit of work is a packed leaf (read whole, for its checksum) or one box
of a shard-packed leaf's target sharding. Units are grouped in jobs of at most
`Staging.job_bytes` staged bytes: what is read, plus the boxes assembled from
it, plus their casts. A unit that costs more is streamed in slabs (see
`streaming`), a job each. Each job is read in a thread while the previous
one's boxes go to their devices in one batched `jax.device_put`; a leaf whose
target sharding has one box (one device, or replicated) is put with that
sharding; other leaves are put box by box onto each device and made one
array with `jax.make_array_from_single_device_arrays`. No computation runs
over a sharded array, and no process waits for another.
"""

import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from etils import epath

from .._format.sidecar import PACK_ALIGNMENT, PACKED, Metadata, itemsize, shard_file
from .._tree.walk import JAX, is_key_dtype, key_data_struct, key_impl, parse_dtype
from . import packfile as _packfile
from . import streaming
from .checksum import crc32, damaged, mismatch
from .packing import plan
from .shard_index import CRC_BLOCK, read_all
from .shard_read import _check, _geometry, _strides, _Target, damaged_chunks, target
from .staging import Job, Staging

# The least a streamed slab of a shard pack may stage: its bytes, plus up to
# two CRC blocks read only to check them. Half of `staging.MIN_WINDOW`.
SLAB_FLOOR = 4 * CRC_BLOCK


@dataclasses.dataclass(eq=False, slots=True)
class _Leaf:
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
    targets: tuple[_Target, ...]
    packed: bool
    left: int = 0  # units still to arrive
    crc: int = 0  # of a streamed packed leaf's bytes so far...
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


def read(
    directory: epath.Path,
    saved: Metadata,
    requests: dict[str, Any],
    *,
    verify: bool,
    staging: Staging,
) -> dict[str, Any]:
    """Reads packed and shard-packed leaves: `{name: request}` to `{name: array}`
    (requests as for `packing.read`), holding at most `staging.max_bytes` of
    host bytes at once."""
    directory = epath.Path(directory)
    leaves = _leaves(directory, saved, requests)
    total = sum(r.record.nbytes for r in requests.values())
    problems: dict[str, list[str]] = {"pack": [], "shards": []}
    reading = _Reading(staging, verify, problems)
    staging.run(reading.jobs(leaves, staging.job_bytes(total)))
    if problems["pack"]:
        raise damaged(directory, problems["pack"])
    if problems["shards"]:
        raise damaged_chunks(directory, problems["shards"])
    return {leaf.name: leaf.result for leaf in leaves}


def _leaves(directory, saved, requests) -> list[_Leaf]:
    chunks = None
    packs = [[directory / pack.file] for pack in saved.packs]  # shared by leaves
    shard_files: dict[int, epath.Path] = {}
    packed, sharded = [], []
    for name, request in requests.items():
        record = request.record
        elem, tail, size, key = _stored_type(record.dtype)
        shape = tuple(record.shape)
        sharding = request.sharding if request.container == JAX else None
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
                    path = directory / shard_file(saved.token, c.process)
                    shard_files[c.process] = path
                paths.append(path)
            boxes = tuple((c.start, c.stop) for c in ordered)
        leaf = _Leaf(
            name,
            request,
            shape,
            tail,
            elem,
            elem if key else np.dtype(request.dtype),
            size,
            paths,
            ordered,
            _geometry(shape, size, boxes, sharding),
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
        _packfile.check_size(packs[pack][0], end)
    return packed + sharded


_ONE_CHUNK = [None]  # a packed leaf's: the whole array, in the pack file


@functools.cache
def _stored_type(text: str):
    """`(element dtype, key data's own axes, bytes per element, is a key)` of
    arrays stored with the dtype named `text`."""
    saved = parse_dtype(text)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        return np.dtype(data.dtype), tuple(data.shape), itemsize(saved), True
    return np.dtype(saved), (), itemsize(saved), False


@dataclasses.dataclass
class _Step:
    """Part of a job: a packed leaf (`box` None) or one box of a shard-packed
    leaf, whole (`slab` None) or one slab of it (global start and shape)."""

    leaf: _Leaf
    box: int | None
    slab: streaming.Box | None = None
    last: bool = True  # the unit is complete after this step


class _Reading:
    def __init__(self, staging: Staging, verify: bool, problems):
        self.staging = staging
        self.verify = verify
        self.problems = problems

    # ------------------------------------------------------------ planning

    def jobs(self, leaves: list[_Leaf], budget: int) -> Iterator[Job]:
        steps: list[_Step] = []
        cost = 0
        for leaf in leaves:
            units = [None] if leaf.packed else range(len(leaf.targets))
            leaf.left = len(units)
            if not units:  # no box of it is on this process's devices
                _finish(leaf)
            for box in units:
                step = _Step(leaf, box)
                c = self._cost(step)
                if c <= budget:
                    if steps and cost + c > budget:
                        yield self._job(steps)
                        steps, cost = [], 0
                    steps.append(step)
                    cost += c
                    continue
                if steps:
                    yield self._job(steps)
                    steps, cost = [], 0
                limit = self._limit(leaf, budget)
                if c <= limit:  # a job of its own
                    yield self._job([step])
                    continue
                for part in self._slabs(step, limit):
                    self.staging.parts += 1
                    yield self._job([part])
        if steps:
            yield self._job(steps)

    def _limit(self, leaf: _Leaf, budget: int) -> int:
        """The most a job of one unit of `leaf`, or one slab of it, stages."""
        if leaf.packed or not self.verify:
            return budget
        # Checked reads are whole 1 MiB blocks: a slab of a chunk may read two
        # more than it needs, however thin it is cut.
        return max(budget, SLAB_FLOOR)

    def _slabs(self, step: _Step, budget: int) -> list[_Step]:
        leaf = step.leaf
        if leaf.packed:
            start, shape = (0,) * len(leaf.shape), leaf.shape
        else:
            t = leaf.targets[step.box]
            start, shape = t.start, t.shape

        def cost(slab):
            return self._cost(_Step(leaf, step.box, slab))

        cut = streaming.slabs(start, shape, budget, cost)
        return [
            _Step(leaf, step.box, slab, last=i == len(cut) - 1)
            for i, slab in enumerate(cut)
        ]

    def _cost(self, step: _Step) -> int:
        """The most bytes `step` stages: reads, boxes assembled, casts."""
        leaf = step.leaf
        if leaf.packed:
            shape = step.slab[1] if step.slab else leaf.shape
            cost = leaf.box_bytes(shape) + PACK_ALIGNMENT
            for _, local, isect in self._parts(step):
                if not streaming.contiguous(isect, shape):
                    cost += leaf.box_bytes(isect)
                cost += leaf.cast_bytes(isect)
            return cost
        t = self._target(step)
        cost = sum(z - a + PACK_ALIGNMENT for _, a, z in self._spans(step, t))
        if not self._viewable(leaf, t):
            cost += leaf.box_bytes(t.shape)
        return cost + leaf.cast_bytes(t.shape)

    def _target(self, step: _Step) -> _Target:
        """The box of a shard-packed leaf's step, with its pieces."""
        leaf = step.leaf
        t = leaf.targets[step.box]
        if step.slab is None:
            return t
        start, shape = step.slab
        stop = tuple(a + n for a, n in zip(start, shape))
        boxes = tuple((c.start, c.stop) for c in leaf.chunks)
        return target(start, stop, boxes, leaf.size)

    def _spans(self, step: _Step, t: _Target):
        """`(chunk index, first byte, end byte)` read of each piece of `t`."""
        out = []
        for p in t.pieces:
            a, z = p.first, p.last
            if self.verify:
                a = a // CRC_BLOCK * CRC_BLOCK
                z = min(-(-z // CRC_BLOCK) * CRC_BLOCK, step.leaf.chunks[p.k].nbytes)
            out.append((p.k, a, z))
        return out

    @staticmethod
    def _viewable(leaf: _Leaf, t: _Target) -> bool:
        if len(t.pieces) != 1:
            return False
        chunk = leaf.chunks[t.pieces[0].k]
        return streaming.contiguous(t.pieces[0].shape, chunk.shape)

    def _parts(self, step: _Step):
        """For a packed leaf's step: `(box, start in the slab, shape)` of each
        target box's overlap with what the step reads."""
        leaf = step.leaf
        if step.slab is None:
            return [(i, t.start, t.shape) for i, t in enumerate(leaf.targets)]
        s_start, s_shape = step.slab
        out = []
        for i, t in enumerate(leaf.targets):
            lo = tuple(max(a, b) for a, b in zip(s_start, t.start))
            hi = tuple(
                min(a + n, b + m)
                for a, n, b, m in zip(s_start, s_shape, t.start, t.shape)
            )
            if all(x < y for x, y in zip(lo, hi)):
                local = tuple(x - a for x, a in zip(lo, s_start))
                out.append((i, local, tuple(y - x for x, y in zip(lo, hi))))
        return out

    # ------------------------------------------------------------- reading

    def _job(self, steps: list[_Step]) -> Job:
        return Job(lambda: self._read(steps), self._put)

    def _read(self, steps: list[_Step]):
        spans: dict[epath.Path, dict[tuple, tuple[int, int]]] = {}
        targets = {}
        for n, step in enumerate(steps):
            leaf = step.leaf
            if leaf.packed:
                record = leaf.request.record
                first, length = 0, record.nbytes
                if step.slab is not None:
                    first = _offset(step.slab[0], leaf.shape, leaf.size)
                    length = leaf.box_bytes(step.slab[1])
                at = record.offset + first
                spans.setdefault(leaf.paths[0], {})[(n, 0)] = (at, at + length)
                continue
            targets[n] = t = self._target(step)
            for k, a, z in self._spans(step, t):
                at = leaf.chunks[k].offset
                spans.setdefault(leaf.paths[k], {})[(n, k)] = (at + a, at + z)
        got: dict[tuple, np.ndarray] = {}
        for path, wanted in spans.items():
            ranges, where = plan(wanted, max_gap=PACK_ALIGNMENT)
            buffers = _packfile.read(path, ranges, empty=self.staging.empty)
            for key, (i, at) in where.items():
                start, stop = wanted[key]
                got[key] = buffers[i][at : at + stop - start]
            del buffers
        entries, done = [], []
        for n, step in enumerate(steps):
            if step.leaf.packed:
                entries += self._packed(step, got.pop((n, 0)))
            else:
                entries += self._sharded(step, targets[n], n, got)
            if step.last:
                done.append(step.leaf)
        return entries, done

    def _packed(self, step: _Step, data: np.ndarray) -> list:
        leaf = step.leaf
        record = leaf.request.record
        if self.verify and record.crc32 is not None:
            # The bytes not summed yet: a leaf's last slab may overlap the one
            # before it (see `streaming.slabs`).
            first = _offset(step.slab[0], leaf.shape, leaf.size) if step.slab else 0
            leaf.crc = crc32(data[leaf.summed - first :], leaf.crc)
            leaf.summed = first + data.nbytes
            if step.last and leaf.crc != record.crc32:
                problem = mismatch(record, "CRC-32", record.crc32, leaf.crc)
                self.problems["pack"].append(problem)
        shape = step.slab[1] if step.slab else leaf.shape
        host = data.view(leaf.elem).reshape(shape + leaf.tail)
        origin = step.slab[0] if step.slab else (0,) * len(shape)
        entries = []
        for i, local, isect in self._parts(step):
            index = tuple(slice(a, a + n) for a, n in zip(local, isect))
            part = host[(*index, ...)]  # a view, even of a 0-d array
            if not streaming.contiguous(isect, shape):
                part = self._copy(part)
            t = leaf.targets[i]
            at = tuple(o + a - s for o, a, s in zip(origin, local, t.start))
            part = self._cast(leaf, part)
            entries.append((leaf, i, at if step.slab else None, part))
        return entries

    def _sharded(self, step: _Step, t: _Target, n: int, got) -> list:
        leaf = step.leaf
        record = leaf.request.record
        spans = self._spans(step, t)
        data = {k: got.pop((n, k)) for k, _, _ in spans}
        if self.verify:
            for k, a, _ in spans:
                found = _check(leaf.chunks[k], a, data[k], record, leaf.paths[k])
                self.problems["shards"] += found
        tail_strides = _strides(leaf.tail, leaf.elem.itemsize)
        starts = {k: a for k, a, _ in spans}
        if self._viewable(leaf, t):
            p = t.pieces[0]
            raw = data[p.k][p.first - starts[p.k] : p.last - starts[p.k]]
            host = raw.view(leaf.elem).reshape(t.shape + leaf.tail)
        else:
            n_bytes = leaf.box_bytes(t.shape)
            host = self.staging.empty(n_bytes).view(leaf.elem)
            host = host.reshape(t.shape + leaf.tail)
            for p in t.pieces:
                host[p.dst] = np.ndarray(
                    p.shape + leaf.tail,
                    dtype=leaf.elem,
                    buffer=data[p.k],
                    offset=p.first - starts[p.k],
                    strides=p.strides + tail_strides,
                )
        box = leaf.targets[step.box]
        at = None
        if step.slab is not None:
            at = tuple(a - s for a, s in zip(step.slab[0], box.start))
        return [(leaf, step.box, at, self._cast(leaf, host))]

    def _copy(self, part: np.ndarray) -> np.ndarray:
        out = self.staging.empty(part.nbytes).view(part.dtype).reshape(part.shape)
        out[...] = part
        return out

    def _cast(self, leaf: _Leaf, host: np.ndarray) -> np.ndarray:
        """`host` as the device will take it: cast (`cast=True`), and in a
        buffer of its own where the CPU would otherwise alias it."""
        if leaf.request.container != JAX:
            return host  # numpy leaves are cast when copied out (`_put`)
        if leaf.dtype == leaf.elem:
            return self.staging.handoff(host)
        n_bytes = host.size * leaf.dtype.itemsize
        out = self.staging.empty(n_bytes).view(leaf.dtype).reshape(host.shape)
        out[...] = host  # `cast=True`
        return out

    # ------------------------------------------------------------- putting

    def _put(self, data) -> list[jax.Array]:
        entries, done = data
        xs, shardings, sinks = [], [], []
        for leaf, box, at, host in entries:
            if leaf.request.container != JAX:
                _into_host(leaf, box, at, host)
            elif at is None and leaf.direct:
                xs.append(host)
                shardings.append(leaf.request.sharding)
                sinks.append((leaf, box, None, None))
            else:
                for device in leaf.targets[box].devices:
                    xs.append(host)
                    shardings.append(_single(device))
                    sinks.append((leaf, box, device, at))
        arrays = jax.device_put(xs, shardings) if xs else []
        del xs
        started = []
        for (leaf, box, device, at), array in zip(sinks, arrays):
            if leaf.on_device is None:
                leaf.on_device = {}
            if device is None:
                leaf.on_device[None] = array
            elif at is None:
                leaf.on_device[(box, device)] = array
            else:
                key = (box, device)
                buffer = leaf.on_device.get(key)
                if buffer is None:
                    t = leaf.targets[box]
                    buffer = streaming.zeros(t.shape + leaf.tail, array.dtype, device)
                full = tuple(at) + (0,) * len(leaf.tail)
                array = leaf.on_device[key] = streaming.update(buffer, array, full)
            started.append(array)
        for leaf in done:
            leaf.left -= 1
            if leaf.left == 0:
                _finish(leaf)
        return started


def _offset(start, shape, size: int) -> int:
    """Bytes into a C-order array of `shape` of the element at `start`."""
    return sum(a * s for a, s in zip(start, _strides(shape, size)))


def _into_host(leaf: _Leaf, box: int, at, host: np.ndarray) -> None:
    """A numpy leaf: its bytes copied out of the staging buffers (and cast)."""
    if at is None:
        leaf.result = np.array(host, dtype=leaf.dtype, copy=True)
        return
    if leaf.result is None:
        leaf.result = np.empty(leaf.shape + leaf.tail, leaf.dtype)
    index = tuple(slice(a, a + n) for a, n in zip(at, host.shape))
    leaf.result[index] = host


def _finish(leaf: _Leaf) -> None:
    if leaf.request.container != JAX:
        return
    parts = leaf.on_device or {}  # none where this process holds no part
    leaf.on_device = None
    if None in parts:
        array = parts[None]
    else:
        array = jax.make_array_from_single_device_arrays(
            leaf.shape + leaf.tail, leaf.request.sharding, list(parts.values())
        )
    if _stored_type(leaf.request.record.dtype)[3]:  # typed PRNG keys
        saved = parse_dtype(leaf.request.record.dtype)
        array = jax.random.wrap_key_data(array, impl=key_impl(saved))
    leaf.result = array


_SINGLE: dict = {}


def _single(device) -> jax.sharding.SingleDeviceSharding:
    found = _SINGLE.get(device)
    if found is None:
        found = _SINGLE[device] = jax.sharding.SingleDeviceSharding(device)
    return found
