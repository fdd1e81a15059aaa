"""The packed layout: unsharded arrays as byte ranges of one pack file.

Orbax spends milliseconds per stored array, so a model of thousands of small
arrays (a deep network plus its optimizer state) costs seconds to save and
restore. Every array that is not sharded (numpy, on one device, or fully
replicated) is instead packed, end to end, into one pack file; only sharded
arrays go through Orbax, one stored array each. Every leaf keeps its name,
its sidecar record (pack, offset, size) and its own restore.

Save (`packed.write`): which leaves are packed, and the pack written with
each leaf's checksum; where each goes is `ranges.layout` (walk order, so a
subtree is one contiguous range; offsets 64-byte aligned), the host arrays
holding their bytes are taken before `save` returns
(`transfer.to_host.host_copies`). Restore (here): the byte ranges of just the
wanted leaves (neighbours merged when close, `ranges.plan`), then arrays made
from the buffers without copying them on CPU.
"""

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from ..._format.checksum import NAME, Running, damaged, mismatch, xxh3
from ..._format.sidecar import PackMetadata
from ..._tree.walk import (
    JAX,
    is_key_dtype,
    key_data_struct,
    key_impl,
    parse_dtype,
)
from .. import ranges as _ranges
from ..ranges import plan

# Bytes of a leaf checked at a time on restore, while later ones are read.
_CHECK_PIECE = 16 << 20


def read(
    directory: epath.Path,
    packs: tuple[PackMetadata, ...],
    requests: dict[str, Any],
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Reads packed leaves: `{name: request}` to `{name: array}`.

    A request has the leaf's sidecar `record`, the target `dtype`, the
    `container` (jax or numpy) and, for jax arrays, the target `sharding`.
    Only the wanted leaves' bytes are read (see `plan`). With `verify`, each
    leaf's bytes are checked against the XXH3-64 its sidecar records, if any,
    in this thread while the reader threads go on reading.
    """
    by_pack: dict[int, dict[str, Any]] = {}
    for name, request in requests.items():
        by_pack.setdefault(request.record.pack, {})[name] = request
    hosts: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for pack, wanted in by_pack.items():
        spans = {}
        for name, request in wanted.items():
            record = request.record
            spans[name] = (record.offset, record.offset + record.nbytes)
        ranges, where = plan(spans)
        check = None
        if verify:
            records = {name: r.record for name, r in wanted.items()}
            check = functools.partial(_check, records, where, problems)
        buffers = _ranges.read(
            directory / packs[pack].file,
            ranges,
            meanwhile=check,
            nbytes=packs[pack].nbytes,
        )
        for name, request in wanted.items():
            i, start = where[name]
            record = request.record
            layout = _layout(record.dtype)
            # One constructor call, not a slice, a view and a reshape: a view
            # of the bytes read (no copy), per leaf of tens of thousands.
            hosts[name] = np.ndarray(
                record.shape + layout.trailing if layout.key else record.shape,
                layout.view,
                buffers[i],
                start,
            )
    if problems:
        raise damaged(directory, problems)
    return _to_arrays(hosts, requests)


def _check(records, where, problems: list[str], buffers, ready) -> None:
    """Checks each leaf's bytes against the XXH3-64 its record holds, in file
    order, as the reads bring them in (see `_ranges.read`); appends a line
    to `problems` for each that differs."""
    # Bytes of each buffer known to be read: `ready` is asked again only past
    # them, for up to `_READY_STEP` more, not once per leaf of thousands.
    known = [0] * len(buffers)
    views = [memoryview(buffer) for buffer in buffers]  # (slices cost less)
    for name, (i, start) in where.items():  # (`plan` lists them in file order)
        record = records[name]
        if record.checksum is None:
            continue
        stop = start + record.nbytes
        if record.nbytes <= _CHECK_PIECE:  # (most leaves: summed in one call)
            if stop > known[i]:
                known[i] = min(max(stop, known[i] + _READY_STEP), len(views[i]))
                ready(i, known[i])
            found = xxh3(views[i][start:stop])
        else:
            running = Running()
            for at in range(start, stop, _CHECK_PIECE):
                end = min(at + _CHECK_PIECE, stop)
                ready(i, end)
                running.update(buffers[i][at:end])
            found = running.value()
        if found != record.checksum:
            problems.append(mismatch(record, NAME, record.checksum, found))


# Bytes beyond a small leaf's that its check waits for at once (see `_check`).
_READY_STEP = 1 << 20


class _Layout(NamedTuple):
    """How a saved dtype's bytes are viewed on host: for a PRNG key, as its
    key data (a trailing axis of `trailing`)."""

    saved: Any  # the saved dtype (a key dtype for keys)
    view: np.dtype  # the dtype of the bytes
    key: bool
    trailing: tuple[int, ...]


@functools.cache
def _layout(text: str) -> _Layout:
    saved = parse_dtype(text)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        return _Layout(saved, np.dtype(data.dtype), True, tuple(data.shape))
    return _Layout(saved, np.dtype(saved), False, ())


def _to_arrays(hosts: dict[str, np.ndarray], requests: dict[str, Any]):
    # (`hosts` a dict, not a list of (name, request, host, layout): that list
    # held 88 more bytes a leaf at the restore's peak.)
    out: dict[str, Any] = {}
    # By target sharding: one `device_put` per sharding costs far less per
    # array than one per array, or one with a list of shardings. Equal
    # shardings share a batch; each object is hashed once (by `id` after:
    # hashing a sharding costs more, per leaf, than the rest of this loop).
    batches: dict[Any, tuple[list[str], list[np.ndarray]]] = {}
    by_id: dict[int, Any] = {}  # sharding's id -> its batch, or `_ELSEWHERE`
    keys: dict[str, Any] = {}  # PRNG key leaves' key dtypes: put as data, wrapped
    for name, host in hosts.items():
        request = requests[name]
        layout = _layout(request.record.dtype)
        if not layout.key and request.dtype != layout.saved:
            host = host.astype(request.dtype)  # `cast=True`
        if request.container != JAX:
            out[name] = host
            continue
        sharding = request.sharding
        batch = by_id.get(id(sharding))
        if batch is None:
            if sharding.is_fully_addressable:  # (JAX computes it each time)
                batch = batches.setdefault(sharding, ([], []))
            else:
                batch = _ELSEWHERE
            by_id[id(sharding)] = batch
        if batch is _ELSEWHERE:
            # Other hosts hold part of the target: each gives its own shards.
            # With no shard here, JAX needs the dtype (it gets no data).
            out[name] = _wrap(
                jax.make_array_from_callback(
                    host.shape,
                    request.sharding,
                    functools.partial(_part, host),
                    dtype=host.dtype,
                ),
                layout.saved,
            )
            continue
        batch[0].append(name)
        batch[1].append(host)
        if layout.key:
            keys[name] = layout.saved
    for sharding, (names, hosted) in batches.items():
        # In batches: JAX's cost per array grows with the length of one call's
        # list (measured: 41 us per array in calls of 4,096, 51 us in one call
        # of 50,000). To the sharding, not its device: though 1.3 us an array
        # quicker, a put to a device gives each array its own sharding, three
        # objects more (measured) for memory to hold and the collector to walk.
        for at in range(0, len(names), _PUT_BATCH):
            arrays = jax.device_put(hosted[at : at + _PUT_BATCH], sharding)
            out.update(zip(names[at : at + _PUT_BATCH], arrays, strict=True))
    for name, saved in keys.items():
        out[name] = _wrap(out[name], saved)
    return out


_PUT_BATCH = 4096  # arrays per `jax.device_put` call
_ELSEWHERE: Any = object()  # (a target partly on other hosts: no batch)


def _wrap(array: jax.Array, saved: Any) -> jax.Array:
    if is_key_dtype(saved):
        return jax.random.wrap_key_data(array, impl=key_impl(saved))
    return array


def _part(host: np.ndarray, index: Any) -> np.ndarray:
    return host[index]
