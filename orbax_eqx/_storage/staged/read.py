"""Packed and shard-packed leaves read through a staging window (see `staging`).

Used where transfers copy (accelerators, or `ORBAX_EQX_STAGING=copy`); on CPU
`packed.read` and `sharded.read` hand their buffers to the devices as
they are. Both kinds of leaf are read the same way here: a packed leaf is a
leaf of one chunk, the whole array, at its offset in the pack file, checked
against the XXH3-64 of all its bytes; a shard-packed leaf has the chunks of
its index, checked per block of its chunk (reads are widened to whole
blocks; see `sharded.index`).

The unit of work is a packed leaf (read whole, for its checksum) or one box
of a shard-packed leaf's target sharding, grouped in jobs of a bounded cost,
or streamed in slabs where larger (see `staged.plan`). Each job is read in a
thread while the previous
one's boxes go to their devices in one batched `jax.device_put`; a leaf whose
target sharding has one box (one device, or replicated) is put with that
sharding; other leaves are put box by box onto each device and made one
array with `jax.make_array_from_single_device_arrays`. No computation runs
over a sharded array, and no process waits for another.
"""

from typing import Any

import jax
import numpy as np
from etils import epath

from ..._format.checksum import NAME, Running, damaged, mismatch
from ..._format.sidecar import PACK_ALIGNMENT, Metadata
from ..._tree.walk import JAX, key_impl, parse_dtype
from .. import ranges as _ranges
from ..boxes import Target, contiguous, strides_of
from ..ranges import plan
from ..sharded.read import check_chunk, damaged_chunks
from ..transfer import streaming
from ..transfer.staging import Job, Staging
from .plan import Leaf, Plan, Step, leaves, offset, stored_type


def read(
    directory: epath.Path,
    saved: Metadata,
    requests: dict[str, Any],
    *,
    verify: bool,
    staging: Staging,
) -> dict[str, Any]:
    """Reads packed and shard-packed leaves: `{name: request}` to `{name: array}`
    (requests as for `packed.read.read`), holding at most `staging.max_bytes` of
    host bytes at once."""
    directory = epath.Path(directory)
    wanted = leaves(directory, saved, requests)
    total = sum(r.record.nbytes for r in requests.values())
    problems: dict[str, list[str]] = {"pack": [], "shards": []}
    # The sizes recorded of pack files (shard packs record none): a pack
    # longer than written is damaged, here as in `packed.read`.
    recorded = {directory / pack.file: pack.nbytes for pack in saved.packs}
    reading = _Reading(staging, verify, problems, recorded)
    steps = reading.plan.jobs(wanted, staging.job_bytes(total), staging)
    staging.run(reading.job(job) for job in steps)
    if problems["pack"]:
        raise damaged(directory, problems["pack"])
    if problems["shards"]:
        raise damaged_chunks(directory, problems["shards"])
    for leaf in wanted:
        if leaf.result is None:  # no box of it is on this process's devices
            _finish(leaf)
    return {leaf.name: leaf.result for leaf in wanted}


class _Reading:
    """Reads and puts the steps of jobs; collects checksum problems."""

    def __init__(self, staging: Staging, verify: bool, problems, recorded):
        self.staging = staging
        self.recorded = recorded
        self.verify = verify
        self.problems = problems
        self.plan = Plan(verify)

    # ------------------------------------------------------------- reading

    def job(self, steps: list[Step]) -> Job:
        return Job(lambda: self._read(steps), self._put)

    def _read(self, steps: list[Step]):
        spans: dict[epath.Path, dict[tuple, tuple[int, int]]] = {}
        targets = {}
        for n, step in enumerate(steps):
            leaf = step.leaf
            if leaf.packed:
                record = leaf.request.record
                first, length = 0, record.nbytes
                if step.slab is not None:
                    first = offset(step.slab[0], leaf.shape, leaf.size)
                    length = leaf.box_bytes(step.slab[1])
                at = record.offset + first
                spans.setdefault(leaf.paths[0], {})[(n, 0)] = (at, at + length)
                continue
            targets[n] = t = self.plan.target(step)
            for k, a, z in self.plan.spans(step, t):
                at = leaf.chunks[k].offset
                spans.setdefault(leaf.paths[k], {})[(n, k)] = (at + a, at + z)
        got: dict[tuple, np.ndarray] = {}
        for path, wanted in spans.items():
            ranges, where = plan(wanted, max_gap=PACK_ALIGNMENT)
            buffers = _ranges.read(
                path,
                ranges,
                nbytes=self.recorded.get(path),
                empty=self.staging.empty,
            )
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

    def _packed(self, step: Step, data: np.ndarray) -> list:
        leaf = step.leaf
        record = leaf.request.record
        if self.verify and record.checksum is not None:
            # The bytes not summed yet: a leaf's last slab may overlap the one
            # before it (see `streaming.slabs`).
            first = offset(step.slab[0], leaf.shape, leaf.size) if step.slab else 0
            if leaf.crc is None:
                leaf.crc = Running()
            leaf.crc.update(data[leaf.summed - first :])
            leaf.summed = first + data.nbytes
            if step.last and leaf.crc.value() != record.checksum:
                found = leaf.crc.value()
                problem = mismatch(record, NAME, record.checksum, found)
                self.problems["pack"].append(problem)
        shape = step.slab[1] if step.slab else leaf.shape
        host = data.view(leaf.elem).reshape(shape + leaf.tail)
        origin = step.slab[0] if step.slab else (0,) * len(shape)
        entries = []
        for i, local, isect in self.plan.parts(step):
            index: tuple[Any, ...] = tuple(
                slice(a, a + n) for a, n in zip(local, isect, strict=True)
            )
            part = host[(*index, Ellipsis)]  # a view, even of a 0-d array
            if not contiguous(isect, shape):
                part = self._copy(part)
            t = leaf.targets[i]
            at = tuple(
                o + a - s for o, a, s in zip(origin, local, t.start, strict=True)
            )
            part = self._cast(leaf, part)
            entries.append((leaf, i, at if step.slab else None, part))
        return entries

    def _sharded(self, step: Step, t: Target, n: int, got) -> list:
        leaf = step.leaf
        record = leaf.request.record
        spans = self.plan.spans(step, t)
        data = {k: got.pop((n, k)) for k, _, _ in spans}
        if self.verify:
            for k, a, _ in spans:
                found = check_chunk(leaf.chunks[k], a, data[k], record, leaf.paths[k])
                self.problems["shards"] += found
        tail_strides = strides_of(leaf.tail, leaf.elem.itemsize)
        starts = {k: a for k, a, _ in spans}
        if self.plan.viewable(leaf, t):
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
        box = leaf.targets[step.index]
        at = None
        if step.slab is not None:
            at = tuple(a - s for a, s in zip(step.slab[0], box.start, strict=True))
        return [(leaf, step.box, at, self._cast(leaf, host))]

    def _copy(self, part: np.ndarray) -> np.ndarray:
        out = self.staging.empty(part.nbytes).view(part.dtype).reshape(part.shape)
        out[...] = part
        return out

    def _cast(self, leaf: Leaf, host: np.ndarray) -> np.ndarray:
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
        for (leaf, box, device, at), array in zip(sinks, arrays, strict=True):
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


def _into_host(leaf: Leaf, box: int, at, host: np.ndarray) -> None:
    """A numpy leaf: its bytes copied out of the staging buffers (and cast)."""
    if at is None:
        leaf.result = np.array(host, dtype=leaf.dtype, copy=True)
        return
    if leaf.result is None:
        leaf.result = np.empty(leaf.shape + leaf.tail, leaf.dtype)
    index = tuple(slice(a, a + n) for a, n in zip(at, host.shape, strict=True))
    leaf.result[index] = host


def _finish(leaf: Leaf) -> None:
    if leaf.request.container != JAX:
        return
    parts = leaf.on_device or {}  # none where this process holds no part
    leaf.on_device = None
    if None in parts:
        array = parts[None]
    else:
        # With no part here, JAX needs the dtype (it has no data to take it from).
        array = jax.make_array_from_single_device_arrays(
            leaf.shape + leaf.tail,
            leaf.request.sharding,
            list(parts.values()),
            dtype=leaf.dtype,
        )
    if stored_type(leaf.request.record.dtype)[3]:  # typed PRNG keys
        saved = parse_dtype(leaf.request.record.dtype)
        array = jax.random.wrap_key_data(array, impl=key_impl(saved))
    leaf.result = array


_SINGLE: dict = {}


def _single(device) -> jax.sharding.SingleDeviceSharding:
    found = _SINGLE.get(device)
    if found is None:
        found = _SINGLE[device] = jax.sharding.SingleDeviceSharding(device)
    return found
