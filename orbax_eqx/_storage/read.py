"""Packed and shard-packed leaves, read through the engine, checked.

A packed leaf is one unit, checked against the XXH3-64 of all its bytes. A
shard-packed leaf has a unit per distinct box of its target sharding on this
process's devices, made of the stored chunks it overlaps (worked out once per
layout), each read widened to whole checksum blocks (see `sharded.index`).
"""

import bisect
import functools
import itertools
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from .._bytes import route as _route
from .._errors import (
    FALL_BACK,
    CheckpointDamagedError,
    CheckpointMismatchError,
    bullet_list,
)
from .._format.checksum import NAME, Running, damaged, mismatch, xxh3
from .._format.sidecar import (
    PACKED,
    SHARDS,
    LeafMetadata,
    Metadata,
    pack_path,
)
from .._tree.walk import JAX, is_key_dtype, key_data_struct, key_impl, parse_dtype
from . import engine, put
from . import ranges as _ranges
from .sharded.index import Chunk, check_blocks, widen
from .sharded.index_read import chunk_path, read_all
from .transfer.staging import Staging


class Request(NamedTuple):
    """One array to read: its sidecar `record`, the target `dtype`, the
    `container` (jax or numpy) and, for jax arrays, the target `sharding`."""

    # A NamedTuple, not a frozen dataclass: a restore makes one per array
    # leaf, and a frozen dataclass sets each field through `object.__setattr__`.
    record: LeafMetadata
    dtype: Any
    container: str | None
    sharding: Any


def read(
    directory: epath.Path,
    saved: Metadata,
    requests: dict[str, Any],
    *,
    verify: bool = True,
    staging: Staging | None = None,
) -> dict[str, Any]:
    """Reads packed, shard-packed and zero-size leaves: `{name: Request}` to
    `{name: array}`. Only the wanted bytes are read; with `verify`, each is
    checked against the checksums its sidecar or index records. Where
    `staging.copy`, bytes go to devices through its window.
    """
    directory = epath.Path(directory)
    chunks: dict[str, list[Chunk]] | None = None
    if any(r.record.data == SHARDS for r in requests.values()):
        chunks = read_all(directory, saved)  # checks every index first
    check_shared(directory, saved, requests, chunks)
    packs = [
        engine.File(
            pack_path(directory, p),
            p.nbytes,
            functools.partial(_ranges.damaged, pack_path(directory, p)),
        )
        for p in saved.packs
    ]
    ends: dict[int, int] = {}
    shard_files: dict[tuple[str, bool], engine.File] = {}
    problems: dict[str, list[str]] = {"pack": [], "shards": []}
    leaves = []
    for name, request in requests.items():
        record = request.record
        if record.data == PACKED:
            end = record.offset + record.nbytes
            ends[record.pack] = max(ends.get(record.pack, 0), end)
            leaves.append(
                _packed(packs[record.pack], request, verify, problems["pack"])
            )
            continue
        # (A zero-size leaf has no chunks: its units, no pieces.)
        ordered = []
        if chunks is not None and 0 not in record.shape:
            ordered = sorted(chunks[name], key=lambda c: c.start)
        files = []
        for c in ordered:
            if (c.file, c.shared) not in shard_files:
                path = chunk_path(directory, c)
                damage = functools.partial(_ranges.damaged, path)
                file = engine.File(path, None, damage, engine.PAD)
                shard_files[c.file, c.shared] = file
            files.append(shard_files[c.file, c.shared])
        found = problems["shards"] if verify else None
        leaves.append(_sharded(request, ordered, files, found))
    for pack, end in ends.items():
        # Now, before anything is planned for sizes only a damaged sidecar claims.
        _ranges.check_size(packs[pack].path, end, saved.packs[pack].nbytes)
    window = put.DEFAULT_WINDOW if staging is None else staging.max_bytes
    results = put.arrays(leaves, staging, window=window)
    if problems["pack"]:
        raise damaged(directory, problems["pack"])
    if problems["shards"]:
        raise damaged_chunks(directory, list(dict.fromkeys(problems["shards"])))
    _check_values(directory, requests, leaves)
    return dict(zip(requests, results, strict=True))


def check_shared(directory: epath.Path, saved: Metadata, names, chunks=None) -> None:
    """Raises, before anything is read, if a shared pack or shard pack that
    leaves `names` are in is gone (deleted by hand: a save deletes only those
    no step refers to), naming those leaves and the file that held them.
    `chunks`: the sharded leaves' chunks (`read_all`), if any is wanted."""
    chunks = chunks or {}
    if not any(p.shared for p in saved.packs) and not any(
        c.shared for leaf in chunks.values() for c in leaf[:1]
    ):
        return
    problems = []
    for path, paths in _shared_files(directory, saved, names, chunks).items():
        if not _route.for_path(path).exists(path):
            shown = ", ".join(f"`{p}`" for p in paths[:5])
            more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
            problems.append(f"{path}, which held leaves {shown}{more}")
    if problems:
        raise CheckpointDamagedError(
            f"The checkpoint in {directory} keeps bytes it shares with other "
            "steps (saved with `dedup=True`) in files that are gone:\n"
            + bullet_list(problems)
            + "\nThey were deleted by hand: orbax_eqx deletes only shared bytes "
            "that no step refers to. Restore another step, and copy a step out "
            "with `python -m orbax_eqx copy` before deleting what it shares."
        )


def _shared_files(directory, saved: Metadata, names, chunks) -> dict:
    """`{shared file: paths of the leaves of `names` it holds}`."""
    held: dict[epath.Path, list[str]] = {}
    for name in names:
        record, pack = saved.leaves[name], saved.leaves[name].pack
        if record.data == PACKED and pack is not None and saved.packs[pack].shared:
            path = pack_path(directory, saved.packs[pack])
            held.setdefault(path, []).append(record.path)
        if record.data != SHARDS:
            continue
        for c in chunks.get(name, ()):
            paths = held.setdefault(chunk_path(directory, c), []) if c.shared else []
            if c.shared and record.path not in paths[-1:]:
                paths.append(record.path)
    return held


FIX_CAST_VALUES = (
    "A cast of such values has no defined result: give those leaves of the "
    "skeleton a float dtype (or a wider integer one), or restore them as saved "
    "and clean the values (`jnp.nan_to_num`, `jnp.clip`) before casting them."
)


def _check_values(directory, requests: dict, leaves: list[put.Leaf]) -> None:
    """Raises for values the reads did not place (`engine.Refused`): bytes of
    bool leaves other than 0 and 1 (damage, where no checksum was checked),
    then values a cast cannot keep."""
    found = {}
    for request, leaf in zip(requests.values(), leaves, strict=True):
        refused = [what for _, _, u in leaf.units for _, what in u.refused or ()]
        if refused:
            found[request.record] = (engine.Refused.total(refused), leaf.dtype)
    _refuse(directory, found)


def _refuse(directory, found: dict) -> None:
    """Raises for `{record: (engine.Refused, dtype cast to)}`, if any."""
    lines = {
        r: f"Leaf `{r.path}` ({r.name}) holds {what.said(dtype)}."
        for r, (what, dtype) in found.items()
    }
    bools = [line for r, line in lines.items() if found[r][0].bools]
    if bools:
        raise CheckpointDamagedError(
            f"Some bool leaves of the checkpoint in {directory} hold bytes other "
            "than 0 and 1, which no save writes (a damaged copy):\n"
            + bullet_list(bools)
            + "\n"
            + FALL_BACK
        )
    if lines:
        raise CheckpointMismatchError(
            f"Some leaves of the checkpoint in {directory} hold values a cast to "
            "the skeleton's dtypes (`cast=True`) cannot keep:\n"
            + bullet_list(list(lines.values()))
            + "\n"
            + FIX_CAST_VALUES
        )


def cast_checked(requests: dict) -> dict:
    """The requests of arrays Orbax would cast as it reads with no check (its
    array store) that are to be read as saved, then cast by `cast_after`
    instead: those a cast may not keep (to an integer dtype), where the saved
    dtype can be read (a jax array of more than 32 bits needs x64)."""
    out = {}
    for name, request in requests.items():
        _, _, saved, key = stored_type(request.record.dtype)
        if key or is_key_dtype(request.dtype):  # (keys are never cast)
            continue
        saved = np.dtype(saved)
        fits = request.container != JAX or saved.itemsize <= 4
        if engine.checked_cast(saved, np.dtype(request.dtype)) and (
            fits or jax.config.read("jax_enable_x64")
        ):
            out[name] = request._replace(dtype=saved)
    return out


def cast_after(directory, requests: dict, loaded: dict) -> None:
    """Casts the arrays of `requests` (as `cast_checked` chose them) in
    `loaded` to their dtypes, on host, each device's part in turn; raises
    for values a cast cannot keep, naming every such leaf."""
    found = {}
    for name, request in requests.items():
        dtype = np.dtype(request.dtype)
        x = loaded[name]
        parts = (
            [x] if request.container != JAX else [s.data for s in x.addressable_shards]
        )
        hosts = [np.asarray(p) for p in parts]
        refused = [r for h in hosts if (r := engine.cast_refused(h, dtype))]
        if refused:
            found[request.record] = (engine.Refused.total(refused), dtype)
            continue
        cast = [h.astype(dtype) for h in hosts]
        if request.container != JAX:
            loaded[name] = cast[0]
            continue
        placed = [
            jax.device_put(h, s.device)
            for h, s in zip(cast, x.addressable_shards, strict=True)
        ]
        loaded[name] = jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, placed, dtype=dtype
        )
    _refuse(directory, found)


@functools.cache
def stored_type(text: str):
    """`(element dtype, key data's own axes, the saved dtype, is a key)` of
    arrays stored with the dtype named `text`."""
    saved = parse_dtype(text)
    if is_key_dtype(saved):
        data = key_data_struct(saved)
        return np.dtype(data.dtype), tuple(data.shape), saved, True
    return np.dtype(saved), (), saved, False


def _leaf(request, units, elem, tail, saved, key) -> put.Leaf:
    shape = tuple(request.record.shape)
    wrap = None
    if key:
        wrap = functools.partial(_wrap, impl=key_impl(saved))
    return put.Leaf(
        shape + tail,
        elem if key else np.dtype(request.dtype),
        request.sharding if request.container == JAX else None,
        units,
        len(shape),
        wrap,
    )


def _wrap(array, impl):
    return jax.random.wrap_key_data(array, impl=impl)


def _packed(file: engine.File, request, verify: bool, problems) -> put.Leaf:
    record = request.record
    elem, tail, saved, key = stored_type(record.dtype)
    shape = tuple(record.shape) + tail
    check = None
    if verify and record.checksum is not None:
        check = RecordCheck(record, problems)
    source = engine.Source(file, record.offset, shape, elem, check)
    box = engine.whole(shape)
    dtype = elem if key else np.dtype(request.dtype)
    unit = engine.Unit(shape, dtype, (engine.Piece(source, box, box),))
    devices = None
    if request.container == JAX:
        held = engine.held(request.sharding, tuple(record.shape))
        if len(held) == 1 and held[0][1] == tuple(record.shape):
            devices = held[0][2]  # every device holds it whole
    start = tuple(a for a, _ in box[: len(record.shape)])
    return _leaf(request, ((start, devices, unit),), elem, tail, saved, key)


class RecordCheck:
    """The XXH3-64 of a packed leaf's bytes, fed in order (slabs may overlap)."""

    __slots__ = ("record", "problems", "running", "summed")
    step = 16 << 20  # bytes summed at a time, while later ones are read
    widens = False

    def __init__(self, record, problems: list[str]):
        self.record, self.problems = record, problems
        self.running: Running | None = None
        self.summed = 0

    def widen(self, first: int, last: int) -> tuple[int, int]:
        return first, last

    def feed(self, at: int, data: np.ndarray) -> None:
        record = self.record
        if at == 0 and data.nbytes == record.nbytes:  # (most leaves: one call)
            self._compare(xxh3(data))
            return
        if self.running is None:
            self.running = Running()
        self.running.update(data[self.summed - at :])
        self.summed = at + data.nbytes
        if self.summed >= record.nbytes:
            self._compare(self.running.value())

    def _compare(self, found: int) -> None:
        if found != self.record.checksum:
            line = mismatch(self.record, NAME, self.record.checksum, found)
            self.problems.append(line)


class BlockCheck:
    """A chunk's bytes against the XXH3-64s of its blocks."""

    widens = True

    def __init__(self, chunk: Chunk, record, path, problems: list[str]):
        self.chunk, self.record, self.path, self.problems = (
            chunk,
            record,
            path,
            problems,
        )
        self.step = chunk.block * max(1, (16 << 20) // chunk.block)

    def widen(self, first: int, last: int) -> tuple[int, int]:
        off = self.chunk.offset
        a, z = widen(self.chunk, first - off, last - off)
        return a + off, z + off

    def feed(self, at: int, data: np.ndarray) -> None:
        self.problems += check_chunk(self.chunk, at, data, self.record, self.path)


def damaged_chunks(directory, problems: list[str]) -> CheckpointDamagedError:
    """The error for chunks whose bytes differ from their checksums."""
    return CheckpointDamagedError(
        f"The data of {len(problems)} chunk(s) of the shard packs of the "
        f"checkpoint in {directory} changed after it was saved (a flipped bit "
        "on disk, or a damaged copy):\n" + bullet_list(problems) + "\nRestore "
        "an earlier step (`oeqx.restore_latest` falls back past damaged "
        "steps); `python -m orbax_eqx verify PATH` checks every leaf."
    )


def check_chunk(chunk: Chunk, a: int, data, record, path) -> list[str]:
    """Checks bytes `[a, ...)` of `chunk` (whole blocks) against its checksums."""
    return [
        f"Leaf `{record.path}` ({record.name}), chunk {chunk.box()} in "
        f"{path.name}, bytes {block * chunk.block}-"
        f"{min((block + 1) * chunk.block, chunk.nbytes)}: {NAME} recorded at "
        f"save {recorded:#018x}, computed from the data now {found:#018x}."
        for block, recorded, found in check_blocks(chunk, a, data)
    ]


def _sharded(request, chunks: list[Chunk], files, problems) -> put.Leaf:
    record = request.record
    elem, tail, saved, key = stored_type(record.dtype)
    shape = tuple(record.shape)
    dtype = elem if key else np.dtype(request.dtype)
    sharding = request.sharding if request.container == JAX else None
    boxes = tuple((c.start, c.stop) for c in chunks)
    checks = [
        None if problems is None else BlockCheck(c, record, f.path, problems)
        for c, f in zip(chunks, files, strict=True)
    ]
    sources = [
        engine.Source(f, c.offset, c.shape + tail, elem, check)
        for c, f, check in zip(chunks, files, checks, strict=True)
    ]
    units = []
    for start, stop, devices, parts in _geometry(shape, boxes, sharding):
        pieces = [
            engine.Piece(sources[k], box + engine.whole(tail), dst + engine.whole(tail))
            for k, box, dst in parts
        ]
        box_shape = tuple(b - a for a, b in zip(start, stop, strict=True))
        units.append((start, devices, engine.Unit(box_shape + tail, dtype, pieces)))
    return _leaf(request, units, elem, tail, saved, key)


@functools.lru_cache(maxsize=4096)
def _geometry(shape, boxes, sharding) -> tuple:
    """`(start, stop, devices, [(chunk, box in it, box in the target)])` of
    each distinct target box here (one, the whole array, without sharding)."""
    if sharding is None:
        held: tuple = (((0,) * len(shape), shape, ()),)
    else:
        held = engine.held(sharding, shape)
    cuts = [sorted({(a[d], b[d]) for a, b in boxes}) for d in range(len(shape))]
    at = {a: k for k, (a, _) in enumerate(boxes)}
    return tuple(
        (start, stop, devices, _parts(start, stop, cuts, at, boxes))
        for start, stop, devices in held
    )


def _parts(start, stop, cuts, at, boxes) -> list[tuple]:
    """`(chunk, box in it, box in the target)` of each stored chunk that the
    target box `[start, stop)` overlaps (`cuts`: the chunks' bounds along
    each dimension; `at`: a chunk's index by its start)."""
    spans = []
    for d, (lo, hi) in enumerate(zip(start, stop, strict=True)):
        i = bisect.bisect_right([b for _, b in cuts[d]], lo)
        spans.append([c for c in cuts[d][i:] if c[0] < hi])
    parts = []
    for cell in itertools.product(*spans):
        k = at[tuple(a for a, _ in cell)]
        c_start, c_stop = boxes[k]
        first = [max(a, s) for a, s in zip(start, c_start, strict=True)]
        end = [min(a, s) for a, s in zip(stop, c_stop, strict=True)]
        box = tuple((x - s, y - s) for x, y, s in zip(first, end, c_start, strict=True))
        dst = tuple((x - s, y - s) for x, y, s in zip(first, end, start, strict=True))
        parts.append((k, box, dst))
    return parts
