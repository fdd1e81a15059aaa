"""Shard packs, written: each process's distinct shards, in one file."""

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import msgspec
import numpy as np
from etils import epath

from ..._bytes import route as _route
from ..._format import schema as _schema
from ..._format import sealed as _sealed
from ..._format.checksum import identity
from ..._format.sidecar import SHARDS, Metadata, shard_file, shard_index
from ..._format.sidecar_read import SHARD_NAME
from .. import ranges as _ranges
from ..ranges import layout
from ..transfer import to_host as _to_host
from .index import MAX_INDEX_BYTES, Chunk, block_size, block_sums, to_bytes


@dataclasses.dataclass
class Local:
    """The chunks one process writes: boxes with their host copies."""

    names: list[Any]  # each chunk's leaf (its name, or a label to name later)
    starts: list[tuple[int, ...]]
    stops: list[tuple[int, ...]]
    hosts: list[np.ndarray]  # emptied once written
    # Host copies still being made (`start_take`): `wait` fills `hosts`.
    pending: Any = None
    # Each chunk's array, for `dedup`'s known identities (emptied with `hosts`).
    arrays: list[Any] = dataclasses.field(default_factory=list)

    def wait(self) -> None:
        if self.pending is not None:
            self.hosts, self.pending = self.pending.result(), None


def take(items: Sequence[tuple[Any, jax.Array]]) -> Local:
    """Host copies of this process's distinct shards of `items` (name, array)."""
    local = start_take(items)
    local.wait()
    return local


def start_take(items: Sequence[tuple[Any, jax.Array]]) -> Local:
    """`take(items)`, returning once the caller may donate or change the
    arrays; `Local.wait()` waits for the rest of the host copies."""
    names, starts, stops, arrays = [], [], [], []
    hosts: list[Any] = []
    copied: list[tuple[int, jax.Array]] = []  # (place in `hosts`, shard)
    for name, x in items:
        # Decided per array, not per shard: 8 devices make 8 shards of each
        # array, and `save` waits for whatever is done per shard here.
        view = _to_host.viewable(x)
        for i, start, stop in _owned(x):
            names.append(name)
            starts.append(start)
            stops.append(stop)
            arrays.append(x)
            if view:
                hosts.append(np.asarray(x.addressable_data(i)))  # no copy
            else:
                copied.append((len(hosts), x.addressable_data(i)))
                hosts.append(None)
    pending = _Pending(hosts, copied, _to_host.start([c[1] for c in copied]))
    return Local(names, starts, stops, [], pending, arrays)


class _Pending:
    """Views taken, copies under way: `result()` puts the copies in place."""

    def __init__(self, hosts: list, copied: list, pending: _to_host.Pending):
        self._hosts, self._copied, self._pending = hosts, copied, pending

    def result(self) -> list[np.ndarray]:
        for (at, _), host in zip(self._copied, self._pending.result(), strict=True):
            self._hosts[at] = host
        return [_plain_bools(host) for host in self._hosts]


def _plain_bools(host: np.ndarray) -> np.ndarray:
    """A bool shard as 0 and 1 bytes (a restore refuses others, as XLA and
    numpy read them differently); any other shard as it is."""
    if host.dtype != np.bool_ or host.size == 0 or host.view(np.uint8).max() <= 1:
        return host
    return host.view(np.uint8) != 0


_PLANS: dict = {}  # (sharding, shape) -> what `_owned` returns


def _owned(x: jax.Array) -> tuple:
    """`(i, start, stop)` of each shard of `x` this process writes: the first
    replica of each distinct non-empty box, `i` its place in `x`'s addressable
    data. Arrays placed alike share the answer: `addressable_shards` costs
    about ten times `addressable_data` (measured: 0.14 s against 0.013 s for
    3,200 shards), and a deep model has few distinct placements."""
    key = (x.sharding, x.shape)
    plan = _PLANS.get(key)
    if plan is None:
        plan = tuple(
            (i, *_box(shard.index, x.shape))
            for i, shard in enumerate(x.addressable_shards)
            if shard.replica_id == 0 and shard.data.size
        )
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def write(
    directory: epath.Path,
    token: str,
    process: int,
    local: Local,
    shared: epath.Path | None = None,
    base: Metadata | None = None,
    leaves: dict[str, Any] | None = None,
    seen: Any = None,
) -> list:
    """Writes this process's shard pack and its index; returns the paths
    written in `directory`. `seen`: with dedup, the XXH3-128s of chunks of
    jax arrays saved before (`get(array, (start, stop))`, and `put`)."""
    local.wait()
    chunks = [
        Chunk(name, process, start, stop, 0, h.nbytes, 0, ())
        for name, start, stop, h in zip(
            local.names, local.starts, local.stops, local.hosts, strict=True
        )
    ]
    files: dict[str, int] | None = None
    own = shard_file(token, process)
    new = list(range(len(chunks)))
    if shared is not None:
        known = _known(base, process, leaves or {})
        files, new = _refer(chunks, local, own, known, seen)
    offsets, nbytes = layout((str(i), chunks[i].nbytes) for i in new)
    pieces = [(offsets[str(i)], local.hosts[i]) for i in new]

    def sums_of() -> list[tuple[int, list[int]]]:
        out = []
        for i in new:
            block = block_size(chunks[i].nbytes)
            out.append((block, block_sums(local.hosts[i], block)))
        return out

    pack = (directory if shared is None else shared) / own
    if pieces or shared is None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            summing = pool.submit(sums_of)
            _ranges.write(pack, pieces, nbytes)
            sums = summing.result()
        for i, (block, x) in zip(new, sums, strict=True):
            chunks[i] = dataclasses.replace(
                chunks[i], offset=offsets[str(i)], block=block, sums=tuple(x)
            )
    _remember(chunks, local, seen)
    local.hosts = local.arrays = []  # let go of device buffers (see `take`)
    if files is not None:
        files[own] = nbytes
        if not pieces:
            del files[own]  # (none written)
    index = directory / shard_index(token, process)
    _route.write_whole(index, to_bytes(token, process, nbytes, chunks, files))
    return [index] if shared is not None else [pack, index]


def _remember(chunks: list, local: Local, seen: Any) -> None:
    """Written: the next save takes these chunks' identities from `seen`."""
    if seen is None:
        return
    for c, x in zip(chunks, local.arrays, strict=True):
        if c.identity is not None:
            seen.put(x, c.identity, (c.start, c.stop))


def _refer(chunks: list, local: Local, own: str, known: dict, seen) -> tuple:
    """Makes each chunk that `known` holds, byte for byte, that chunk (in
    place); returns `({file: size} of the shared files referred to, with
    `own` first, and the indices of the chunks still to write)`."""
    files, new = {own: 0}, []
    arrays = local.arrays or [None] * len(chunks)
    for i, (c, h, x) in enumerate(zip(chunks, local.hosts, arrays, strict=True)):
        found = seen.get(x, (c.start, c.stop)) if seen is not None else None
        found = found or identity(h)
        c = dataclasses.replace(c, file=own, shared=True, identity=found)
        old = known.get((c.name, c.start, c.stop))
        if old is not None and old[0].identity == c.identity:
            chunks[i] = old[0]
            files[old[0].file] = old[1]
        else:
            chunks[i] = c
            new.append(i)
    return files, new


def _known(base: Metadata | None, process: int, leaves: dict[str, Any]) -> dict:
    """`{(leaf, start, stop): (chunk, size of its file)}` of the chunks the
    base step's shard index of `process` records in shared shard packs, of
    leaves of the same dtype and shape as in `leaves`; none where the base
    has none, or its index cannot be read (the save then writes them all)."""
    index = _base_index(base, process)
    if index is None:
        return {}
    assert base is not None
    files = [] if index.files is msgspec.UNSET else index.files
    found = {}
    for name, rows in index.chunks.items():
        if not _same_array(base.leaves.get(name), leaves.get(name)):
            continue
        for row in rows:
            if not isinstance(row.file, int) or row.file >= len(files):
                continue
            start, stop, at = tuple(row.start), tuple(row.stop), files[row.file]
            sums = tuple(int(x, 16) for x in row.xxh3s)
            chunk = Chunk(
                name, process, start, stop, row.offset, row.nbytes, row.block,
                sums, at.file, True, row.xxh3_128 or None,
            )  # fmt: skip
            found[(name, start, stop)] = (chunk, at.nbytes)
    return found


def _base_index(base: Metadata | None, process: int) -> Any:
    """The base step's shard index of `process`, if it can be read, is
    sealed, is that step's and lists only shared shard packs; else None."""
    if base is None or process >= base.shard_files:
        return None
    path = epath.Path(base.directory) / shard_index(base.token, process)
    try:
        raw = _route.read_bounded(path, MAX_INDEX_BYTES)
        if not _sealed.check(raw, ValueError):
            return None
        index = msgspec.json.decode(raw, type=_schema.ShardIndex)
    except Exception:
        return None
    files = [] if index.files is msgspec.UNSET else index.files
    if (
        not index.shared
        or (index.token, index.process) != (base.token, process)
        or not all(SHARD_NAME.fullmatch(f.file) for f in files)
    ):
        return None
    return index


def _same_array(old: Any, record: Any) -> bool:
    """Whether the base's leaf `old` and this save's record are sharded
    arrays of one dtype and shape."""
    return (
        old is not None
        and old.data == SHARDS
        and isinstance(record, dict)
        and record.get("data") == SHARDS
        and (old.dtype, list(old.shape or ())) == (record["dtype"], record["shape"])
    )


def describe(sharding: jax.sharding.Sharding) -> str:
    """A sharding as text for the sidecar: `P('data', None) over data=2, model=4`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = ", ".join(
            repr(tuple(p)) if isinstance(p, (list, tuple)) else repr(p)
            for p in sharding.spec
        )
        mesh = ", ".join(f"{a}={n}" for a, n in sharding.mesh.shape.items())
        return f"P({spec}) over {mesh}"
    devices = len(sharding.device_set)
    return f"{type(sharding).__name__} over {devices} devices"


def _box(index, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(start, stop)` of a shard's index (a tuple of slices) in `shape`."""
    pairs = [s.indices(n)[:2] for s, n in zip(index, shape, strict=False)]
    return tuple(a for a, _ in pairs), tuple(z for _, z in pairs)
