"""The packed layout: unsharded arrays as byte ranges of one pack file.

Orbax spends milliseconds per stored array, so a model of thousands of small
arrays (a deep network plus its optimizer state) costs seconds to save and
restore. Every array that is not sharded (numpy, on one device, or fully
replicated) is instead packed, end to end, into one pack file; only sharded
arrays go through Orbax, one stored array each. Every leaf keeps its name,
its sidecar record (pack, offset, size) and its own restore.

Save: which leaves are packed, where each goes (walk order, so a subtree is
one contiguous range; offsets 64-byte aligned), and the host arrays holding
their bytes, taken before `save` returns (see `host_copies`). Restore: the
byte ranges of just the wanted leaves (neighbours merged when close), then
arrays made from the buffers without copying them on CPU.
"""

import concurrent.futures
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from ..._format.sidecar import PACK_ALIGNMENT, PackMetadata
from ..._tree.walk import (
    JAX,
    container,
    is_key_dtype,
    key_data_struct,
    key_impl,
    parse_dtype,
)
from .. import ranges as _packfile
from ..checksum import CRC32, NAMES, Running, damaged, data_sum, mismatch
from ..transfer import to_host as _to_host
from ..transfer.to_host import on_cpu as on_cpu

# Two wanted ranges closer than this are read as one: a read call costs more
# than reading the bytes between them.
MAX_GAP = 1 << 20
# Bytes of a leaf checked at a time on restore, while later ones are read.
_CHECK_PIECE = 16 << 20


def packable(x: Any) -> bool:
    """Whether an array leaf goes in the pack: every copy of it is the whole array."""
    if container(x) != JAX:
        return True
    return isinstance(x, jax.Array) and x.is_fully_replicated


def layout(sizes: Iterable[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Offsets of `(name, nbytes)` leaves packed in order, and the pack's size."""
    offsets, cursor = {}, 0
    for name, size in sizes:
        cursor += -cursor % PACK_ALIGNMENT
        offsets[name] = cursor
        cursor += size
    return offsets, cursor


def write(
    path: epath.Path,
    pieces: Sequence[tuple[int, np.ndarray]],
    nbytes: int,
    checksums: bool = True,
    algorithm: str = CRC32,
) -> list[int]:
    """Writes pack file `path` (see `_packfile.write`); returns each piece's
    checksum `algorithm` (see `checksum.Running`; none without `checksums`).

    The checksums are computed in a second thread while the file is written:
    both release the GIL, so on two cores they cost about the time of the
    slower one.
    """
    if not checksums:
        _packfile.write(path, pieces, nbytes)
        return []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        crcs = pool.submit(lambda: [data_sum(x, algorithm) for _, x in pieces])
        _packfile.write(path, pieces, nbytes)
        return crcs.result()


def host_copies(values: list[Any]) -> list[np.ndarray]:
    """Host arrays holding the leaves' bytes as they are now, safe from later changes.

    The caller may change numpy arrays, or donate jax arrays, as soon as
    `save` returns, so this is done before it returns:

    - numpy arrays are copied;
    - a jax array on CPU is seen by numpy without a copy: the view holds the
      buffer, and JAX does not reuse a buffer that numpy still holds, so
      donating the array later copies instead (tested in
      `tests/test_packing.py`). Orbax relies on the same;
    - other jax arrays are copied to host memory: small ones gathered on
      their device first, a copy per batch, large ones one by one, all
      transfers started first (see `to_host`).
    """
    return start_host_copies(values)()


def start_host_copies(
    values: list[Any], copy_numpy: bool = True
) -> Callable[[], list[np.ndarray]]:
    """Starts `host_copies(values)`; returns, once the caller may donate or
    change the values, a function that waits for the copies and returns them
    (stacks of small arrays are copied to host there; see `to_host.start`).
    `copy_numpy=False` (a save that waits for its writes before returning)
    takes C-contiguous numpy arrays as they are."""
    # Fully replicated: this host's first copy is the whole array. Taken from
    # its own device, so that nothing is computed over the others (nor, for
    # keys, across hosts), and only one copy is transferred.
    out: list[Any] = [None] * len(values)
    on_device = []
    for i, x in enumerate(values):
        if container(x) == JAX:
            on_device.append(i)
        elif copy_numpy:
            out[i] = np.array(x, order="C", copy=True)
        else:
            out[i] = np.ascontiguousarray(x)  # a copy only if not contiguous
    pending = _to_host.start([_one_copy(values[i]) for i in on_device])

    def result() -> list[np.ndarray]:
        for i, host in zip(on_device, pending.result()):
            out[i] = host
        return out

    return result


def _one_copy(x: jax.Array) -> jax.Array:
    # An array on one device is its own first copy; `addressable_data(0)`
    # would make a new array object (and sharding) for it.
    if len(x.sharding.device_set) == 1:
        return x
    return x.addressable_data(0)


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
    leaf's bytes are checked against the CRC-32 its sidecar records, if any,
    in this thread while the reader threads go on reading.
    """
    by_pack: dict[int, dict[str, Any]] = {}
    for name, request in requests.items():
        by_pack.setdefault(request.record.pack, {})[name] = request
    hosts, problems = {}, []
    for pack, wanted in by_pack.items():
        spans = {name: _span(r.record) for name, r in wanted.items()}
        ranges, where = plan(spans)
        check = None
        if verify:
            records = {name: r.record for name, r in wanted.items()}
            check = functools.partial(_check, records, where, problems)
        buffers = _packfile.read(
            directory / packs[pack].file,
            ranges,
            meanwhile=check,
            nbytes=packs[pack].nbytes,
        )
        for name, request in wanted.items():
            i, start = where[name]
            hosts[name] = _view(buffers[i], start, request.record)
    if problems:
        raise damaged(directory, problems)
    return _to_arrays(hosts, requests)


def _check(records, where, problems: list[str], buffers, ready) -> None:
    """Checks each leaf's bytes against the CRC-32 its record holds, in file
    order, as the reads bring them in (see `_packfile.read`); appends a line
    to `problems` for each that differs."""
    todo = [name for name in records if records[name].crc32 is not None]
    for name in sorted(todo, key=lambda name: where[name]):
        record = records[name]
        i, start = where[name]
        running, stop = Running(record.sum_algorithm), start + record.nbytes
        for at in range(start, stop, _CHECK_PIECE):
            end = min(at + _CHECK_PIECE, stop)
            ready(i, end)
            running.update(buffers[i][at:end])
        found = running.value()
        if found != record.crc32:
            kind = NAMES[record.sum_algorithm]
            problems.append(mismatch(record, kind, record.crc32, found))


def _span(record) -> tuple[int, int]:
    return record.offset, record.offset + record.nbytes


def plan(
    spans: dict[str, tuple[int, int]], max_gap: int = MAX_GAP
) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """Merges byte spans into few ranges to read.

    **Returns:** `(ranges, where)`: the `[start, stop)` ranges, in file order,
    and for each name the index of its range and its offset inside it.
    """
    ranges: list[tuple[int, int]] = []
    where = {}
    for name, (start, stop) in sorted(spans.items(), key=lambda kv: kv[1]):
        if ranges and start - ranges[-1][1] <= max_gap:
            first = ranges[-1][0]
            ranges[-1] = (first, max(stop, ranges[-1][1]))
        else:
            first = start
            ranges.append((start, stop))
        where[name] = (len(ranges) - 1, start - first)
    return ranges, where


def _view(buffer: np.ndarray, start: int, record) -> np.ndarray:
    """The stored array, as a view of the bytes read (no copy)."""
    raw = buffer[start : start + record.nbytes]
    dtype = parse_dtype(record.dtype)
    if is_key_dtype(dtype):
        data = key_data_struct(dtype)
        return raw.view(data.dtype).reshape(record.shape + data.shape)
    return raw.view(np.dtype(dtype)).reshape(record.shape)


def _to_arrays(hosts: dict[str, np.ndarray], requests: dict[str, Any]):
    out: dict[str, Any] = {}
    # By target sharding: one `device_put` per sharding costs far less per
    # array than one per array, or one with a list of shardings.
    batches: dict[Any, dict[str, np.ndarray]] = {}
    addressable: dict[int, bool] = {}  # by sharding: JAX computes it each time
    for name, host in hosts.items():
        request = requests[name]
        saved = parse_dtype(request.record.dtype)
        if not is_key_dtype(saved) and request.dtype != saved:
            host = host.astype(request.dtype)  # `cast=True`
        if request.container != JAX:
            out[name] = host
            continue
        sharding = request.sharding
        local = addressable.get(id(sharding))
        if local is None:
            local = addressable[id(sharding)] = sharding.is_fully_addressable
        if not local:
            # Other hosts hold part of the target: each gives its own shards.
            # With no shard here, JAX needs the dtype (it gets no data).
            out[name] = _wrap(
                jax.make_array_from_callback(
                    host.shape,
                    request.sharding,
                    lambda index, h=host: h[index],
                    dtype=host.dtype,
                ),
                saved,
            )
        else:
            batches.setdefault(sharding, {})[name] = host
    for sharding, batch in batches.items():
        names = list(batch)
        # In batches: JAX's cost per array grows with the length of one call's
        # list (measured: 41 us per array in calls of 4,096, 51 us in one call
        # of 50,000).
        for at in range(0, len(names), _PUT_BATCH):
            part = names[at : at + _PUT_BATCH]
            arrays = jax.device_put([batch[n] for n in part], sharding)
            for name, array in zip(part, arrays):
                out[name] = _wrap(array, parse_dtype(requests[name].record.dtype))
    return out


_PUT_BATCH = 4096  # arrays per `jax.device_put` call


def _wrap(array: jax.Array, saved: Any) -> jax.Array:
    if is_key_dtype(saved):
        return jax.random.wrap_key_data(array, impl=key_impl(saved))
    return array
