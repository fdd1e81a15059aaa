"""Shard packs, read: any target sharding built from the stored chunks.

For each array, the target sharding says which box each of this process's
devices holds. Each distinct box is built from the stored chunks it overlaps:
of each chunk, only the byte range from the overlap's first element to its
last is read, widened to whole checksum blocks of that chunk (see
`sharded.index.block_size`: at most a 64th of the chunk, or 1 MiB, at each
end) so that every byte read is checked. Ranges are merged only across the
padding between chunks (`GAP` bytes): a process reads what its devices hold
and little more, never a neighbour's chunk. (A box that splits a chunk along
a later dimension than the first, a column strip of a row-major chunk, reads
the chunk's rows that hold it: `[first, last]` of the overlap.)

A box that is one contiguous range of a stored chunk (exactly the chunk, on
the saving mesh, or a run of its leading rows, onto more devices along the
first dimension) is a view of the bytes read, handed to `jax.device_put`
without a copy on CPU; so is a box made of whole chunks stored one after the
other along its first dimension (onto fewer devices along it). Other boxes
are assembled in an aligned buffer of their own, from reads into buffers of
their own, let go once the batch is assembled: no read buffer outlives the
restore unless a restored array is a view of it. Boxes held by several
devices (replication) are read once. Each array is then made with one
`jax.make_array_from_callback` (a batched transfer of every box to its
devices): no computation, no collective. An array none of whose boxes is on
this process's devices is made with its dtype and no data.

Leaves are read a batch at a time: a batch stops growing once its reads
reach `window` bytes, or its reads that are copied (assembled boxes) reach
an eighth of the bytes this process holds (at least 1 MiB, at most 64 MiB),
so the bytes read but not yet handed to a device stay bounded whatever the
model's size (a single larger leaf is one batch), or once it has `PIECES`
pieces, so that the bookkeeping of a read (a few hundred bytes
of Python objects per piece) stays bounded too on models of many small
sharded leaves.
"""

import collections
import math
from typing import Any

import jax
import numpy as np
from etils import epath

from ..._errors import CheckpointDamagedError, bullet_list
from ..._format.checksum import NAME
from ..._format.sidecar import PACK_ALIGNMENT, Metadata, itemsize, shard_file
from ..._tree.walk import JAX, is_key_dtype, key_data_struct, key_impl, parse_dtype
from .. import ranges as _ranges
from ..boxes import Target, geometry, start_of, strides_of
from ..ranges import plan
from .index import Chunk, check_blocks, widen
from .index_read import read_all

DEFAULT_WINDOW = 1 << 30
# Bytes read to be copied into assembled boxes, per batch: transient memory.
COPY_WINDOW = 64 << 20
MIN_COPY_WINDOW = 1 << 20
PIECES = 4096  # pieces of chunks read in one batch at most
GAP = PACK_ALIGNMENT  # the most bytes between ranges merged into one read


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
    leaves: dict[str, tuple] = {}
    for name, request in requests.items():
        ordered = sorted(chunks[name], key=lambda c: c.start)
        size = itemsize(parse_dtype(request.record.dtype))
        sharding = request.sharding if request.container == JAX else None
        targets = geometry(
            tuple(request.record.shape),
            size,
            tuple((c.start, c.stop) for c in ordered),
            sharding,
        )
        leaves[name] = (ordered, targets, size)
    # Bytes read only to be copied into assembled boxes are transient: at
    # most an eighth of what this process holds, at a time (and a leaf).
    held = sum(math.prod(t.shape) * s for _, ts, s in leaves.values() for t in ts)
    copy_window = min(COPY_WINDOW, max(MIN_COPY_WINDOW, held // 8))
    out: dict[str, Any] = {}
    batch: dict[str, tuple] = {}
    staged = copied = pieces = 0
    for name, leaf in leaves.items():
        batch[name] = leaf
        for t in leaf[1]:
            n = sum(p.last - p.first for p in t.pieces)
            staged += n
            copied += 0 if t.viewed else n
            pieces += len(t.pieces)
        if staged >= window or copied >= copy_window or pieces >= PIECES:
            out.update(_read_batch(directory, saved.token, batch, requests, verify))
            batch, staged, copied, pieces = {}, 0, 0, 0
    if batch:
        out.update(_read_batch(directory, saved.token, batch, requests, verify))
    return out


def _read_batch(directory, token, batch: dict[str, tuple], requests, verify: bool):
    # Per chunk, one byte range covering what every box of the batch wants of
    # it; kept (a box is a view of it) or copied (into assembled boxes).
    wanted: dict[tuple, list] = {}  # (name, k) -> [chunk, a, z, kept]
    for name, (ordered, targets, _) in batch.items():
        for t in targets:
            for p in t.pieces:
                a, z = p.first, p.last
                if verify:
                    a, z = widen(ordered[p.k], a, z)
                span = wanted.get((name, p.k))
                if span is None:
                    wanted[(name, p.k)] = [ordered[p.k], a, z, t.viewed]
                else:
                    span[1], span[2] = min(a, span[1]), max(z, span[2])
                    span[3] = span[3] or t.viewed
    # Per file and kind, few reads: merged across the padding between chunks
    # only, so that what is copied is let go once assembled, and no process
    # reads what another's devices hold.
    by_file: dict[tuple, dict[tuple, tuple[int, int]]] = {}
    for key, (chunk, a, z, kept) in wanted.items():
        spans = by_file.setdefault((chunk.process, kept), {})
        spans[key] = (chunk.offset + a, chunk.offset + z)
    got: dict[tuple, np.ndarray] = {}  # (name, k) -> the chunk's bytes [a, z)
    placed: dict[tuple, tuple] = {}  # (name, k) -> (the buffer read, at)
    problems = []
    for (process, _), spans in sorted(by_file.items()):
        ranges, where = plan(spans, max_gap=GAP)
        path = epath.Path(directory) / shard_file(token, process)
        buffers = _ranges.read(path, ranges)
        for key, (i, at) in where.items():
            chunk, a, z, _ = wanted[key]
            got[key] = buffers[i][at : at + z - a]
            placed[key] = (buffers[i], at)
            if verify:
                problems += check_chunk(
                    chunk, a, got[key], requests[key[0]].record, path
                )
        del buffers
    if problems:
        raise damaged_chunks(directory, problems)
    return {
        name: _assemble(name, targets, requests[name], wanted, got, placed)
        for name, (_, targets, _) in batch.items()
    }


def damaged_chunks(directory, problems: list[str]) -> CheckpointDamagedError:
    """The error for chunks whose bytes differ from their checksums."""
    return CheckpointDamagedError(
        f"The data of {len(problems)} chunk(s) of the shard packs of the "
        f"checkpoint in {directory} changed after it was saved (a flipped bit "
        "on disk, or a damaged copy):\n" + bullet_list(problems) + "\nRestore "
        "an earlier step (`oeqx.restore_latest` falls back past damaged "
        "steps); `python -m orbax_eqx verify PATH` checks every leaf."
    )


def check_chunk(chunk: Chunk, a: int, data: np.ndarray, record, path) -> list[str]:
    """Checks bytes `[a, ...)` of `chunk` (whole blocks) against its checksums."""
    problems = []
    for block, recorded, found in check_blocks(chunk, a, data):
        problems.append(
            f"Leaf `{record.path}` ({record.name}), chunk {chunk.box()} in "
            f"{path.name}, bytes {block * chunk.block}-"
            f"{min((block + 1) * chunk.block, chunk.nbytes)}: {NAME} recorded at "
            f"save {recorded:#018x}, computed from the data now {found:#018x}."
        )
    return problems


def _joined(name, t: Target, wanted, placed) -> np.ndarray | None:
    """The bytes of box `t` as one view of a buffer read, if it is made of
    whole chunks stacked along its first dimension (`t.stacked`) that were
    read whole, one after the other, into that buffer (a shard pack holds a
    process's chunks of a leaf in order, so restoring onto fewer devices
    along that dimension finds them so); else None."""
    if not t.stacked:
        return None
    buffer, begin = placed[(name, t.pieces[0].k)]
    at = begin
    for p in t.pieces:
        chunk, a, _, _ = wanted[(name, p.k)]
        here, there = placed[(name, p.k)]
        if a != 0 or here is not buffer or there != at:
            return None
        at += chunk.nbytes
    return buffer[begin:at]


def _assemble(name, targets: tuple[Target, ...], request, wanted, got, placed) -> Any:
    record = request.record
    saved = parse_dtype(record.dtype)
    key = is_key_dtype(saved)
    if key:  # stored as its key data
        data = key_data_struct(saved)
        elem, tail = np.dtype(data.dtype), tuple(data.shape)
    else:
        elem, tail = np.dtype(saved), ()
    tail_strides = strides_of(tail, elem.itemsize)
    hosts = []
    for t in targets:
        if t.contiguous:
            # The box is one range of the chunk (the chunk itself, or some
            # of its leading rows): its bytes as read, no copy.
            p = t.pieces[0]
            a = wanted[(name, p.k)][1]
            raw = got[(name, p.k)][p.first - a : p.last - a]
            hosts.append(raw.view(elem).reshape(t.shape + tail))
            continue
        joined = _joined(name, t, wanted, placed)
        if joined is not None:  # whole chunks, one after the other: no copy
            hosts.append(joined.view(elem).reshape(t.shape + tail))
            continue
        size = math.prod(t.shape) * math.prod(tail) * elem.itemsize
        out = _ranges.aligned_empty(size).view(elem).reshape(t.shape + tail)
        for p in t.pieces:
            a = wanted[(name, p.k)][1]
            out[p.dst] = np.ndarray(
                p.shape + tail,
                dtype=elem,
                buffer=got[(name, p.k)],
                offset=p.first - a,
                strides=p.strides + tail_strides,
            )
        hosts.append(out)
    if not key and np.dtype(request.dtype) != elem:
        hosts = [h.astype(request.dtype) for h in hosts]  # `cast=True`
    if request.container != JAX:
        return hosts[0]
    shape = tuple(record.shape)
    by_start = {t.start: h for t, h in zip(targets, hosts, strict=True)}
    # One batched transfer of every device's box (on CPU, aligned buffers are
    # taken as they are). The index has no entries for key data's own axes.
    # With no box here, JAX needs the dtype (it has no data to take it from),
    # and for a sharding of one box asks for it anyway, to put on no device:
    # it gets an array of no memory.
    dtype = elem if key else np.dtype(request.dtype)
    if not targets:
        nothing = np.broadcast_to(np.zeros((), dtype), shape + tail)
        by_start = collections.defaultdict(lambda: nothing)
    array = jax.make_array_from_callback(
        shape + tail,
        request.sharding,
        lambda index: by_start[start_of(index, shape)],
        dtype=dtype,
    )
    if key:
        return jax.random.wrap_key_data(array, impl=key_impl(saved))
    return array
