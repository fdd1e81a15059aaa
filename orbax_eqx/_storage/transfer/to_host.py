"""Host copies of a save's arrays: small ones gathered on their device first.

`save` must hold every byte before it returns, and a device-to-host copy
costs a round trip whatever its size. So where copies are real, arrays under
`SMALL` bytes are grouped by device, dtype and shape, stacked on their device
(no collective), copied once per batch and split on host. Batches are bounded
(`STACK`, `BATCH`, `IN_FLIGHT`), share one length per group so each compiles
once, and at most `NEW_COMPILES` groups compile per save.
"""

import collections
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._tree.walk import JAX, container, is_key_dtype
from .pool import Lease

SMALL = 1 << 20  # arrays under this many bytes are gathered
STACK = 32  # arrays per stack at most (compile time grows with it)
BATCH = 64 << 20  # bytes per stack at most
IN_FLIGHT = 256 << 20  # bytes of stacks on devices not yet copied to host
MIN_GROUP = 4  # fewer arrays of a (device, dtype, shape) go one by one
NEW_COMPILES = 16  # stacks of new shapes compiled per save at most
# Device copies of large arrays (see above) take at most this part of the
# memory each device has free when the save starts.
DEVICE_SHARE = 0.5

_COMPILED: set = set()  # (device, dtype, shape, length) of stacks compiled


@functools.cache
def on_cpu(sharding: jax.sharding.Sharding) -> bool:
    """Whether every device of `sharding` is a CPU (host memory)."""
    devices: set[Any] = sharding.device_set  # jax's Device type is partly typed
    return all(d.platform == "cpu" for d in devices)


@jax.jit
def _stack(*xs):
    return jnp.stack(xs)


def copies(xs: Sequence[jax.Array]) -> list[np.ndarray]:
    """Host copies of single-device jax arrays (typed PRNG keys: of their key
    data), safe from later changes to the arrays once this returns."""
    return start(xs).result()


class Pending:
    """Host copies being made; `result()` waits for the rest and returns them."""

    def __init__(self, out: list, waiting: collections.deque, copied: list):
        self._out = out
        self._waiting = waiting
        self._copied = copied  # (index, device copy) of large arrays

    def result(self) -> list[np.ndarray]:
        while self._waiting:
            batch, stacked = self._waiting.popleft()
            _split(batch, stacked, self._out)
        for _, copy in self._copied:  # every transfer started, then waited for
            copy.copy_to_host_async()
        while self._copied:
            i, copy = self._copied.pop()
            self._out[i] = np.asarray(copy)  # and the device copy is let go
        return self._out


def start(xs: Sequence[jax.Array], force: bool = False) -> Pending:
    """Starts host copies of single-device jax arrays, as `copies` makes them,
    and returns once the caller may donate or change the arrays: views and
    one-by-one copies are done, stacks of small arrays are dispatched on their
    devices (at most `IN_FLIGHT` bytes of them not yet copied to host).
    `force`: CPU arrays are copied as an accelerator's are, not viewed."""
    out: list[Any] = [None] * len(xs)
    xs = list(xs)
    groups: dict[tuple, list[int]] = {}
    one_by_one = []
    for i, x in enumerate(xs):
        aval = x.aval  # (one attribute: `x.shape`, `x.dtype` each cost more)
        if _is_key(aval.dtype):
            xs[i] = x = jax.random.key_data(x)  # on the array's own device
            aval = x.aval
        dtype, shape = aval.dtype, aval.shape
        how = _how(x.sharding, dtype, force)
        if how is _VIEW:
            out[i] = np.asarray(x)  # no copy; see the module's docstring
        elif how is not _ONE and 0 < math.prod(shape) * how[1] < SMALL:
            groups.setdefault((how[0], dtype, shape), []).append(i)
        else:
            one_by_one.append(i)
    batches = _batches(groups, one_by_one)
    copied = _device_copies(xs, one_by_one, force)
    for i in one_by_one:
        xs[i].copy_to_host_async()
    waiting: collections.deque[tuple[tuple[int, ...], jax.Array]] = collections.deque()
    in_flight = 0
    for batch in batches:
        stacked = _stack(*(xs[i] for i in batch))
        stacked.copy_to_host_async()
        waiting.append((batch, stacked))
        in_flight += stacked.nbytes
        while in_flight > IN_FLIGHT:
            done, done_stack = waiting.popleft()
            in_flight -= _split(done, done_stack, out)
    for i in one_by_one:
        out[i] = np.asarray(xs[i])
    return Pending(out, waiting, copied)


def _device_copies(xs: list, one_by_one: list[int], force: bool) -> list:
    """Copies on their own devices the arrays of `one_by_one` that fit the
    devices' free memory (see the module's docstring), starts their transfers
    to host, and takes them out of `one_by_one`. Returns `(index, copy)`."""
    room: dict[Any, int] = {}
    chosen: list[tuple[int, Any]] = []
    rest = []
    for i in one_by_one:
        x = xs[i]
        how = _how(x.sharding, x.dtype, force)
        if how is _VIEW or how is _ONE:
            rest.append(i)
            continue
        device = how[0]
        if device not in room:
            room[device] = _free(device)
        size = x.nbytes
        if size <= room[device]:
            room[device] -= size
            chosen.append((i, x))
        else:
            rest.append(i)
    one_by_one[:] = rest
    if not chosen:
        return []
    copies = jax.device_put(
        [x for _, x in chosen], [x.sharding for _, x in chosen], may_alias=False
    )
    # Their transfers to host are started by `Pending.result()`, in the save's
    # background thread: on a GPU (jax 0.11.2, H100) `copy_to_host_async`
    # returned only once most of the bytes had crossed (99 arrays of 0.5 GiB:
    # 0.06 s of calls against 0.09 s for `jax.device_get`, and 0.006 s for
    # the device copies; `benchmarks/gpu_transfer_probe.py`).
    return [(i, copy) for (i, _), copy in zip(chosen, copies, strict=True)]


def _free(device) -> int:
    """Bytes of device copies `device` may take now (see `DEVICE_SHARE`)."""
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without the figure may raise instead
        stats = None
    if not stats or "bytes_limit" not in stats:
        return IN_FLIGHT  # CPU devices copying with `force`, say
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return max(0, int(free * DEVICE_SHARE))


_VIEW, _ONE = object(), object()


def viewable(x: jax.Array) -> bool:
    """Whether every host copy of `x`'s shards is numpy's view of its buffer
    (CPU devices; typed keys are copied as key data)."""
    dtype = x.dtype
    return not _is_key(dtype) and _how(x.sharding, dtype, False) is _VIEW


@functools.cache
def _is_key(dtype) -> bool:
    return is_key_dtype(dtype)


@functools.cache
def _how(sharding: jax.sharding.Sharding, dtype, force: bool):
    """How arrays of `dtype` placed by `sharding` are copied to host: `_VIEW`
    (seen by numpy where they are), `_ONE` (one by one), or `(device, bytes
    per element)` (gathered if small)."""
    if on_cpu(sharding) and not force:
        return _VIEW
    if len(sharding.device_set) != 1 or jax.dtypes.itemsize_bits(dtype) < 8:
        return _ONE  # sub-byte dtypes: numpy holds them unpacked
    device: Any = next(iter(sharding.device_set))  # (partly typed in jax)
    kind = sharding.memory_kind
    if kind is not None and kind != device.default_memory().kind:
        return _ONE  # already in host memory, say
    return device, np.dtype(dtype).itemsize


def _batches(groups, one_by_one: list[int]) -> list[tuple[int, ...]]:
    """Batches of array indices to stack, each of its group's one length (the
    last padded with its last array); groups too small, or past the compile
    budget, join `one_by_one`."""
    batches, compiles = [], 0
    for (device, dtype, shape), members in sorted(
        groups.items(), key=lambda kv: -len(kv[1])
    ):
        count = len(members)
        each = math.prod(shape) * np.dtype(dtype).itemsize
        most = max(1, min(STACK, BATCH // each))
        length = -(-count // -(-count // most))  # balanced: few padded
        signature = (device, dtype, shape, length)
        if count < MIN_GROUP or (
            signature not in _COMPILED and compiles >= NEW_COMPILES
        ):
            one_by_one.extend(members)
            continue
        if signature not in _COMPILED:
            _COMPILED.add(signature)
            compiles += 1
        for at in range(0, count, length):
            batch = members[at : at + length]
            batches.append(tuple(batch) + (batch[-1],) * (length - len(batch)))
    one_by_one.sort()
    return batches


def _split(batch: tuple[int, ...], stacked: jax.Array, out: list) -> int:
    host = np.asarray(stacked)
    for j, i in enumerate(batch):
        out[i] = host[j, ...]  # a view, even of a 0-d array
    return stacked.nbytes


def host_copies(values: list[Any]) -> list[np.ndarray]:
    """Host arrays of the leaves' bytes as they are now, safe from later changes."""
    return start_host_copies(values)()


def start_host_copies(
    values: list[Any], copy_numpy: bool = True, lease: Lease | None = None
) -> Callable[[], list[np.ndarray]]:
    """Starts `host_copies(values)`; returns, once the caller may donate or
    change the values, a function that waits for the copies and returns them
    (stacks of small arrays are copied to host there; see `start`).
    `copy_numpy=False` (a save that waits for its writes before returning)
    takes C-contiguous numpy arrays as they are; else numpy arrays are copied
    into buffers of `lease`, if given (see `pool`)."""
    # Fully replicated: this host's first copy is the whole array. Taken from
    # its own device, so that nothing is computed over the others (nor, for
    # keys, across hosts), and only one copy is transferred.
    out: list[Any] = [None] * len(values)
    on_device = []
    for i, x in enumerate(values):
        if container(x) == JAX:
            on_device.append(i)
        elif copy_numpy and lease is not None:
            out[i] = lease.copy(x)
        elif copy_numpy:
            out[i] = np.array(x, order="C", copy=True)
        else:
            out[i] = np.ascontiguousarray(x)  # a copy only if not contiguous
    if lease is not None:
        lease.done()  # idle buffers this save did not reuse go
    pending = start([_one_copy(values[i]) for i in on_device])

    def result() -> list[np.ndarray]:
        for i, host in zip(on_device, pending.result(), strict=True):
            out[i] = host
        return out

    return result


def _one_copy(x: jax.Array) -> jax.Array:
    # An array on one device is its own first copy; `addressable_data(0)`
    # would make a new array object (and sharding) for it.
    if len(x.sharding.device_set) == 1:
        return x
    return x.addressable_data(0)


def gather(x: jax.Array) -> np.ndarray:
    """A host copy of a jax array this process holds whole (typed PRNG keys: of
    their key data), assembled shard by shard: no computation over the array."""
    out = None
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        data = shard.data
        if is_key_dtype(data.dtype):
            data = jax.random.key_data(data)  # on the shard's own device
        host = np.asarray(data)
        if out is None:
            out = np.empty(tuple(x.shape) + host.shape[x.ndim :], host.dtype)
        out[shard.index] = host
    if out is None:  # callers gather only arrays this process holds whole
        raise RuntimeError(f"no replica-0 shard of {x.shape} on this process")
    return out
