"""Arrays made of the engine's units: as they are on CPU, staged elsewhere.

On CPU the units' hosts are the arrays' buffers. Where transfers copy
(accelerators, or an explicit `max_staged_bytes`) units go through the
staging window, a unit larger than a job streamed into its device buffer.
No computation runs over a sharded array, and no process waits for another.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import engine
from .transfer import streaming
from .transfer.staging import Job, Staging

DEFAULT_WINDOW = 1 << 30  # bytes read per batch at most, on CPU
# Bytes read only to be copied in, per batch (transient): at most an eighth
# of what the units hold, between these.
COPY_WINDOW = 256 << 20
MIN_COPY_WINDOW = 1 << 20
PIECES = 4096  # pieces per batch at most (a few hundred bytes of bookkeeping each)
_PUT_BATCH = 4096  # arrays per `jax.device_put` call


@dataclasses.dataclass(eq=False, slots=True)
class Leaf:
    """An array to make from units: `units` are `(box start, devices, unit)`
    (the start on the first `ndim` axes; a typed PRNG key's own axes are
    whole); `sharding` None for a numpy array (one unit, the whole array);
    `wrap` makes the result from the array (typed PRNG keys)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    units: Sequence[tuple[tuple[int, ...], tuple, engine.Unit]]
    ndim: int
    wrap: Callable[[Any], Any] | None = None
    result: Any = None
    parts: dict | None = None  # staged: what is on devices
    left: int = 0  # staged: units still to arrive


def arrays(
    leaves: Sequence[Leaf],
    staging: Staging | None = None,
    *,
    window: int = DEFAULT_WINDOW,
    counts: engine.Counts | None = None,
    advance: Callable[[int], None] | None = None,
) -> list[Any]:
    """Reads the leaves' units and makes each leaf's array (see the module's
    docstring); returns them in order. `advance(nbytes)` is told the bytes of
    each batch once it is read."""
    if staging is not None and staging.copy:
        _staged(leaves, staging)
        return [leaf.result for leaf in leaves]
    units = [u for leaf in leaves for _, _, u in leaf.units]
    for batch, nbytes in _batches(units, window):
        engine.read(batch, counts=counts)
        if advance is not None:
            advance(nbytes)
    _made(leaves)
    return [leaf.result for leaf in leaves]


def _batches(units: list[engine.Unit], window: int):
    """`(units, their bytes)` of each batch to read, in file order."""
    held = sum(math.prod(u.shape) * u.dtype.itemsize for u in units)
    copy_window = min(COPY_WINDOW, max(MIN_COPY_WINDOW, held // 8))
    batch: list[engine.Unit] = []
    staged = copied = pieces = 0
    for u in sorted(units, key=_file_order):
        full = staged >= window or copied >= copy_window or pieces >= PIECES
        # Never between units of one tensor (a fused qkv): its bytes once.
        if full and not _shared(batch[-1], u):
            yield batch, staged
            batch, staged, copied, pieces = [], 0, 0, 0
        batch.append(u)
        found = [engine.span(p) for p in u.pieces]
        nbytes = sum(last - first for first, last in found)
        staged += nbytes
        copied += 0 if engine.view_start(u, found) is not None else nbytes
        pieces += len(u.pieces)
    if batch:
        yield batch, staged


def _file_order(u: engine.Unit):
    """Units in the order of their first bytes: a disk reads forward, and a
    tensor that several units need (a fused qkv) is read once in a batch."""
    if not u.pieces:
        return ("", 0)
    p = u.pieces[0]
    return (str(p.source.file.path), p.source.offset)


def _shared(a: engine.Unit, b: engine.Unit) -> bool:
    """Whether units `a` and `b` read the same stored array."""
    mine = {id(p.source) for p in a.pieces}
    return any(id(p.source) in mine for p in b.pieces)


def _whole(leaf: Leaf) -> engine.Unit | None:
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
    unit: engine.Unit
    at: tuple[int, ...] | None = None
    last: bool = True
    full: tuple[int, ...] = ()  # the unit's shape, for a slab


def _cost(u: engine.Unit) -> int:
    """The most bytes reading `u` stages: its reads and its own buffer."""
    found = [engine.span(p) for p in u.pieces]
    spans = [
        (first, last) if p.source.check is None else p.source.check.widen(first, last)
        for p, (first, last) in zip(u.pieces, found, strict=True)
    ]
    if engine.view_start(u, found) is not None:
        return sum(z - a + engine.PAD for a, z in spans)
    own = math.prod(u.shape) * u.dtype.itemsize + engine.PAD
    return own + sum(
        z - a + engine.PAD
        for p, (a, z), f in zip(u.pieces, spans, found, strict=True)
        if (a, z) != f or not engine.runs(u, p)
    )


def _cuttable(u: engine.Unit) -> bool:
    """Whether every piece of `u` can be cut along the unit's axes."""
    return all(p.perm is None and len(p.box) == len(p.dst) for p in u.pieces)


def _clip(u: engine.Unit, start, shape) -> engine.Unit:
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
    if u.refused is None:
        u.refused = []  # (the parts' refusals are the unit's)
    return engine.Unit(tuple(shape), u.dtype, pieces, refused=u.refused)


def _jobs(leaves: Sequence[Leaf], budget: int):
    """The steps of each staged job, in order."""
    steps: list[_Step] = []
    cost = 0
    for leaf in leaves:
        for start, devices, u in leaf.units:
            c = _cost(u)
            if c > budget:
                if steps:
                    yield steps
                    steps, cost = [], 0
                yield from _alone(_Step(leaf, start, devices, u), c, budget)
                continue
            if steps and cost + c > budget:
                yield steps
                steps, cost = [], 0
            steps.append(_Step(leaf, start, devices, u))
            cost += c
    if steps:
        yield steps


def _alone(step: _Step, cost: int, budget: int):
    """The jobs of a unit that costs more than `budget`: itself, or its slabs."""
    u = step.unit
    widened = any(
        p.source.check is not None and p.source.check.widens for p in u.pieces
    )
    limit = max(budget, SLAB_FLOOR) if widened else budget
    # Slabs go to devices that hold the whole unit, or into a numpy leaf.
    whole_here = step.devices is not None or step.leaf.sharding is None
    if cost <= limit or not whole_here or not _cuttable(u):
        yield [step]  # a job of its own
        return
    cut = streaming.slabs(
        (0,) * len(u.shape), u.shape, limit, lambda b: _cost(_clip(u, *b))
    )
    for i, (at, shape) in enumerate(cut):
        part = _clip(u, at, shape)
        yield [step._replace(unit=part, at=at, last=i == len(cut) - 1, full=u.shape)]


def _staged(leaves: Sequence[Leaf], staging: Staging) -> None:
    total = sum(
        math.prod(u.shape) * u.dtype.itemsize
        for leaf in leaves
        for _, _, u in leaf.units
    )
    budget = staging.job_bytes(total)

    def job(steps: list[_Step]) -> Job:
        def fill():
            engine.read([s.unit for s in steps], empty=staging.empty, gap=engine.PAD)
            return steps

        return Job(fill, lambda done: _put(done, staging))

    for leaf in leaves:
        leaf.left = len(leaf.units)
    staging.run(job(steps) for steps in _jobs(leaves, budget))
    for leaf in leaves:
        if leaf.result is None:  # no box of it is on this process's devices
            _finish(leaf)


def _put(steps: list[_Step], staging: Staging) -> list[jax.Array]:
    """Starts the transfers of a job's hosts; returns what to wait for."""
    xs, shardings, sinks = _transfers(steps, staging)
    placed = jax.device_put(xs, shardings) if xs else []
    del xs
    for s in steps:  # the staging buffers go once their transfers are done
        s.unit.host = None
    started = [
        _place(s, device, array)
        for (s, device), array in zip(sinks, placed, strict=True)
    ]
    for s in steps:
        if s.last:
            s.leaf.left -= 1
            if s.leaf.left == 0 and s.leaf.result is None:
                _finish(s.leaf)
    return started


def _transfers(steps: list[_Step], staging: Staging) -> tuple[list, list, list]:
    """A job's hosts to put, their shardings and `(step, device)`; numpy
    leaves and leaves not all here are made at once."""
    xs, shardings, sinks = [], [], []
    for s in steps:
        leaf, host = s.leaf, s.unit.host
        if leaf.sharding is None:
            _into_host(s)
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
    return xs, shardings, sinks


def _place(s: _Step, device: Any, array: jax.Array) -> jax.Array:
    """Records a step's array among its leaf's parts (a slab: into one)."""
    if s.leaf.parts is None:
        s.leaf.parts = {}
    parts = s.leaf.parts
    key = None if device is None else (s.start, device)
    if s.at is not None:
        buffer = parts.get(key)
        if buffer is None:
            buffer = streaming.zeros(s.full, array.dtype, device)
        array = streaming.update(buffer, array, s.at)
    parts[key] = array
    return array


def _into_host(s: _Step) -> None:
    """A numpy leaf's bytes, copied out of the staging buffers."""
    leaf, host = s.leaf, s.unit.host
    if s.at is None:
        leaf.result = np.array(host, copy=True)
        return
    if leaf.result is None:
        leaf.result = np.empty(leaf.shape, leaf.dtype)
    at = tuple(zip(s.at, s.unit.shape, strict=True))
    leaf.result[tuple(slice(a, a + n) for a, n in at)] = host


def _finish(leaf: Leaf) -> None:
    parts, leaf.parts = leaf.parts or {}, None
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
