"""Shard packs, read: any target sharding built from the stored chunks.

For each array, the target sharding says which box each of this process's
devices holds. Each distinct box is built from the stored chunks it overlaps:
of each chunk, only the byte range from the overlap's first element to its
last is read (widened to whole CRC blocks, so that every byte read is
checked), with few large `preadv`s into aligned buffers (see `packfile`).
A box that is exactly one stored chunk (restoring onto the saving mesh) is a
view of the bytes read, handed to `jax.device_put` without a copy on CPU;
other boxes are assembled in an aligned buffer of their own. Boxes held by
several devices (replication) are read once. Each array is then made with
one `jax.make_array_from_callback` (a batched transfer of every box to its
devices): no computation, no collective.

Leaves are read a batch at a time: a batch stops growing once its reads
reach `window` bytes, so the bytes read but not yet handed to a device stay
bounded whatever the model's size (a single larger leaf is one batch).
"""

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from .._errors import CheckpointDamagedError, bullet_list
from .._format.sidecar import Metadata, itemsize, shard_file
from .._tree.walk import (
    JAX,
    is_key_dtype,
    key_data_struct,
    key_impl,
    parse_dtype,
)
from . import packfile as _packfile
from .packing import plan
from .shard_index import CRC_BLOCK, Chunk, read_all

DEFAULT_WINDOW = 1 << 30


@dataclasses.dataclass
class _Part:
    """One chunk's overlap with one target box."""

    chunk: Chunk
    lo: tuple[int, ...]  # the overlap, in the array's coordinates
    hi: tuple[int, ...]


@dataclasses.dataclass
class _Box:
    start: tuple[int, ...]
    stop: tuple[int, ...]
    devices: list[Any]  # target devices holding this box; [] for numpy
    parts: list[_Part]


def read(
    directory: epath.Path,
    saved: Metadata,
    requests: dict[str, Any],
    *,
    verify: bool = True,
    window: int = DEFAULT_WINDOW,
) -> dict[str, Any]:
    """Reads leaves stored in shard packs: `{name: request}` to `{name: array}`.

    A request has the leaf's sidecar `record`, the target `dtype`, the
    `container` (jax or numpy) and, for jax arrays, the target `sharding`.
    """
    chunks = read_all(epath.Path(directory), saved)
    out: dict[str, Any] = {}
    batch: dict[str, list[_Box]] = {}
    staged = 0
    for name, request in requests.items():
        boxes = _boxes(request, chunks[name])
        batch[name] = boxes
        size = itemsize(parse_dtype(request.record.dtype))
        staged += (
            sum(math.prod(_shape(p.lo, p.hi)) for b in boxes for p in b.parts) * size
        )
        if staged >= window:
            out.update(_read_batch(directory, saved.token, batch, requests, verify))
            batch, staged = {}, 0
    if batch:
        out.update(_read_batch(directory, saved.token, batch, requests, verify))
    return out


def _boxes(request, chunks: Sequence[Chunk]) -> list[_Box]:
    shape = tuple(request.record.shape)
    if request.container == JAX:
        by_box: dict[tuple, _Box] = {}
        indices = request.sharding.addressable_devices_indices_map(shape)
        for device, index in indices.items():
            start, stop = _box(index, shape)
            key = (start, stop)
            if key not in by_box:
                by_box[key] = _Box(start, stop, [], [])
            by_box[key].devices.append(device)
        boxes = list(by_box.values())
    else:
        boxes = [_Box((0,) * len(shape), shape, [], [])]
    exact = {(c.start, c.stop): c for c in chunks}
    for b in boxes:
        c = exact.get((b.start, b.stop))
        if c is not None:  # the saving layout: the box is one stored chunk
            b.parts.append(_Part(c, c.start, c.stop))
            continue
        for c in chunks:
            lo = tuple(max(a, s) for a, s in zip(b.start, c.start))
            hi = tuple(min(a, s) for a, s in zip(b.stop, c.stop))
            if all(x < y for x, y in zip(lo, hi)):
                b.parts.append(_Part(c, lo, hi))
    return boxes


def _box(index, shape):
    start, stop = [], []
    for s, n in zip(index, shape):
        a, b, _ = s.indices(n)
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


def _shape(start, stop) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(start, stop))


def _strides(shape: Sequence[int], size: int) -> tuple[int, ...]:
    strides, step = [], size
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _span(part: _Part, size: int) -> tuple[int, int]:
    """The byte range of `part.chunk` from the overlap's first element to just
    past its last, widened to whole CRC blocks (within the chunk)."""
    c = part.chunk
    strides = _strides(c.shape, size)
    first = sum((lo - s) * st for lo, s, st in zip(part.lo, c.start, strides))
    last = sum((hi - 1 - s) * st for hi, s, st in zip(part.hi, c.start, strides))
    return first, last + size


def _read_batch(directory, token, batch: dict[str, list[_Box]], requests, verify):
    # Per chunk, one byte range covering what every box of the batch wants of it.
    wanted: dict[tuple, tuple[Chunk, int, int]] = {}
    for name, boxes in batch.items():
        size = itemsize(parse_dtype(requests[name].record.dtype))
        for b in boxes:
            for p in b.parts:
                a, z = _span(p, size)
                if verify:
                    a = a // CRC_BLOCK * CRC_BLOCK
                    z = min(-(-z // CRC_BLOCK) * CRC_BLOCK, p.chunk.nbytes)
                key = _key(name, p.chunk)
                if key in wanted:
                    _, a0, z0 = wanted[key]
                    a, z = min(a, a0), max(z, z0)
                wanted[key] = (p.chunk, a, z)
    # Per file, few large reads.
    got: dict[tuple, np.ndarray] = {}  # chunk key -> its bytes [a, z)
    by_file: dict[int, dict[tuple, tuple[int, int]]] = {}
    for key, (chunk, a, z) in wanted.items():
        spans = by_file.setdefault(chunk.process, {})
        spans[key] = (chunk.offset + a, chunk.offset + z)
    problems = []
    for process, spans in by_file.items():
        ranges, where = plan(spans)
        path = epath.Path(directory) / shard_file(token, process)
        buffers = _packfile.read(path, ranges)
        for key, (i, at) in where.items():
            chunk, a, z = wanted[key]
            got[key] = buffers[i][at : at + z - a]
            if verify:
                problems += _check(chunk, a, got[key], requests[key[0]].record, path)
    if problems:
        raise CheckpointDamagedError(
            f"The data of {len(problems)} chunk(s) of the shard packs of the "
            f"checkpoint in {directory} changed after it was saved (a flipped bit "
            "on disk, or a damaged copy):\n" + bullet_list(problems) + "\nRestore "
            "an earlier step (`oeqx.restore_latest` falls back past damaged "
            "steps); `python -m orbax_eqx verify PATH` checks every leaf."
        )
    return {
        name: _assemble(name, boxes, requests[name], wanted, got)
        for name, boxes in batch.items()
    }


def _key(name: str, chunk: Chunk) -> tuple:
    return name, chunk.process, chunk.start


def _check(chunk: Chunk, a: int, data: np.ndarray, record, path) -> list[str]:
    """Checks bytes `[a, ...)` of `chunk` (whole CRC blocks) against its CRCs."""
    problems = []
    view = memoryview(data)
    for at in range(0, len(view), CRC_BLOCK):
        block = (a + at) // CRC_BLOCK
        found = zlib.crc32(view[at : at + CRC_BLOCK])
        if found != chunk.crcs[block]:
            problems.append(
                f"Leaf `{record.path}` ({record.name}), chunk {chunk.box()} in "
                f"{path.name}, bytes {block * CRC_BLOCK}-"
                f"{min((block + 1) * CRC_BLOCK, chunk.nbytes)}: CRC-32 recorded at "
                f"save {chunk.crcs[block]:#010x}, computed from the data now "
                f"{found:#010x}."
            )
    return problems


def _assemble(name, boxes: list[_Box], request, wanted, got) -> Any:
    record = request.record
    saved = parse_dtype(record.dtype)
    key = is_key_dtype(saved)
    data = key_data_struct(saved) if key else None
    elem = np.dtype(data.dtype) if key else np.dtype(saved)
    tail = tuple(data.shape) if key else ()
    size = itemsize(saved)
    hosts = []
    for b in boxes:
        shape = _shape(b.start, b.stop)
        only = b.parts[0] if len(b.parts) == 1 else None
        if only is not None and (only.chunk.start, only.chunk.stop) == (
            b.start,
            b.stop,
        ):
            _, a, _ = wanted[_key(name, only.chunk)]
            if a == 0:  # the chunk is the box: its bytes as read, no copy
                raw = got[_key(name, only.chunk)][: only.chunk.nbytes]
                hosts.append(raw.view(elem).reshape(shape + tail))
                continue
        out = _packfile.aligned_empty(math.prod(shape) * size).view(elem)
        out = out.reshape(shape + tail)
        for p in b.parts:
            _, a, _ = wanted[_key(name, p.chunk)]
            src = _overlap(got[_key(name, p.chunk)], a, p, size, elem, tail)
            out[tuple(slice(x - s, y - s) for x, y, s in zip(p.lo, p.hi, b.start))] = (
                src
            )
        hosts.append(out)
    if not key and np.dtype(request.dtype) != elem:
        hosts = [h.astype(request.dtype) for h in hosts]  # `cast=True`
    if request.container != JAX:
        return hosts[0]
    shape = tuple(record.shape)
    by_box = {(b.start, b.stop): h for b, h in zip(boxes, hosts)}
    # One batched transfer of every device's box (on CPU, aligned buffers are
    # taken as they are). The index has no entries for key data's own axes.
    array = jax.make_array_from_callback(
        shape + tail,
        request.sharding,
        lambda index: by_box[_box(index[: len(shape)], shape)],
    )
    if key:
        return jax.random.wrap_key_data(array, impl=key_impl(saved))
    return array


def _overlap(raw: np.ndarray, a: int, p: _Part, size: int, elem, tail) -> np.ndarray:
    """The overlap `p` as a view of `raw`, which holds bytes `[a, ...)` of its
    chunk in C order (no copy; read only)."""
    c = p.chunk
    strides = _strides(c.shape, size)
    first = sum((lo - s) * st for lo, s, st in zip(p.lo, c.start, strides))
    return np.ndarray(
        _shape(p.lo, p.hi) + tail,
        dtype=elem,
        buffer=raw,
        offset=first - a,
        strides=strides + _strides(tail, elem.itemsize),
    )
