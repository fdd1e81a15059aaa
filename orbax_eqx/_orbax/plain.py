"""Plain Orbax checkpoints: items that Orbax's own PyTree handlers wrote
(`PyTreeCheckpointHandler`, `StandardCheckpointHandler`, `ocp.v1.save_pytree`;
OCDBT or not, zarr v2 or v3): an `_METADATA` file and an array store, no
sidecar.

`restore` fills a skeleton from one: its arrays matched to the skeleton's
array leaves by key path (Orbax names each by its keys' text), checked with
the same all-differences message as an orbax_eqx checkpoint, read by Orbax;
classes, static fields and Python values come from the skeleton. `read` lists
what one holds for `verify` and the command line (from Orbax's public
`metadata()`, and the handler that wrote it from `_CHECKPOINT_METADATA`), and
`StoreReader` reads its arrays (or an orbax_eqx item's Orbax-stored ones) a
block of whole chunks at a time.

A plain checkpoint may come from anywhere: before Orbax reads it, its files
are checked to be regular files, its `_METADATA` to be of a sane size, and
every name Orbax will use as a storage key to stay inside the item.
"""

import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from .._bytes.route import read_bounded
from .._errors import (
    CheckpointDamagedError,
    CheckpointMismatchError,
    OrbaxEqxError,
    RebuildError,
    SidecarError,
    inline_list,
)
from .._format.locate import PLAIN_METADATA
from .._format.sidecar import STORED, LeafMetadata, Metadata
from .._restore.check import check
from .._restore.read import batches, release_memory
from .._restore.shardings import resolve
from .._storage.orbax_store.files import check as check_store_files
from .._tree.names import join, key_part
from .._tree.values import encode
from .._tree.walk import ARRAY, JAX, NUMPY, NUMPY_SCALAR, SCALAR, container, walk

PYTHON = "python"  # the `container` of a Python scalar Orbax stored
# Orbax's record of a checkpoint: the handler that wrote each item, metrics.
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
_METADATA_MAX = 256 << 20  # bytes of an item's `_METADATA`, at most (as a sidecar)
_SMALL_JSON_MAX = 16 << 20  # bytes of a `_CHECKPOINT_METADATA`, at most
_HANDLER_MAX = 300  # characters of a handler's recorded name, at most
# What a handler's recorded name may be: a dotted Python name.
_HANDLER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# What Orbax may name an array in its store: a relative path whose segments
# are names (the name is joined to the item's directory to find the array's
# files): no `..`, no leading `/`, no backslash or NUL.
_STORAGE_NAME = re.compile(r"[^/\\\x00]+(/[^/\\\x00]+)*")
# Dtypes an array of a plain checkpoint may have: numbers and booleans
# (numpy's, and ml_dtypes' bfloat16, float8, int4...).
_DTYPE_KINDS = "biufcV"
# Options of `EqxRestore` that a plain checkpoint can honour, with their defaults
# for the rest (which act on names and records it does not have).
_UNSUPPORTED = {"prefix": None, "renames": None, "report": False}
# Seconds one open or read of an array may take: a local read never comes
# near, and a stalled remote one fails rather than hangs.
TIMEOUT = 300.0
_OCDBT_CACHE = 16 << 20  # bytes of OCDBT's b-tree nodes kept
# Bytes of a block read at once, at most: TensorStore holds each chunk's
# compressed and decoded bytes besides the block while it reads, so smaller
# blocks keep the peak near the budget (measured: benchmarks/stats_memory.py).
MAX_BLOCK = 16 << 20
# What TensorStore appends to its errors: the whole spec it opened (kilobytes
# of JSON) and where in its C++ sources the error arose.
_APPENDED = re.compile(r"\s*\[(tensorstore_spec|source locations)='.*?'\]", re.S)
_MAX_TEXT = 240  # characters of a library's error kept in ours, at most


class PlainCheckpointError(OrbaxEqxError, ValueError):
    """A plain Orbax checkpoint whose metadata cannot be read."""


@dataclasses.dataclass(frozen=True)
class PlainMetadata(Metadata):
    """A plain Orbax item as the tools see it: every array as a leaf stored in
    Orbax's array store (`data="orbax"`, `key` Orbax's own name for it), with
    no modules, no classes and no Python values.

    - `handler`: the handler that wrote it, as Orbax recorded it, or None.
    - `ocdbt`, `zarr3`: how its array store is laid out.
    - `unread`: `{name: why}` of what Orbax's metadata lists that is no array
        the tools read (strings, odd dtypes, unsafe names); not in `leaves`.

    A jax array's leaf has `container="jax"` and the sharding Orbax recorded
    (as text) in `sharding`; a numpy array's `"numpy"`; a Python scalar's
    `"python"`.
    """

    handler: str | None = None
    ocdbt: bool = False
    zarr3: bool = False
    unread: dict[str, str] = dataclasses.field(default_factory=dict)


def _orbax_metadata(handler, item: epath.Path, cannot: Callable[[Exception], Any]):
    """Orbax's metadata of the plain item, read by Orbax once its files are
    checked; `cannot(error)` is raised for what Orbax cannot read."""
    check_store_files(item)  # Orbax's reads would block on a FIFO there
    _check_size(item / PLAIN_METADATA, _METADATA_MAX)
    try:
        _check_names(item, read_bounded(item / PLAIN_METADATA, _METADATA_MAX))
    except FileNotFoundError:
        pass  # Orbax's read says so
    try:
        return handler.metadata(item)
    except OrbaxEqxError:
        raise
    except Exception as e:  # Orbax's and TensorStore's errors, whatever they are
        raise cannot(e) from e


def read(item: epath.Path) -> PlainMetadata:
    """What the plain Orbax item at `item` holds, from Orbax's metadata."""

    def cannot(e: Exception) -> PlainCheckpointError:
        return PlainCheckpointError(
            f"{item} looks like a plain Orbax checkpoint (it has {PLAIN_METADATA}), "
            f"but Orbax cannot read its metadata: {tensorstore_text(e)}. The "
            "checkpoint is damaged or incomplete; use another step."
        )

    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = _orbax_metadata(handler, item, cannot)
    finally:
        handler.close()
    leaves: dict[str, LeafMetadata] = {}
    unread: dict[str, str] = {}
    for path, m in jtu.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]:
        name = join([key_part(k) for k in path])
        record, why = _record(name, jtu.keystr(path), m)
        if record is not None:
            leaves[name] = record
        if why:
            unread[name] = why
    return PlainMetadata(
        directory=os.fspath(item),
        format_version=0,
        versions={},
        leaves=leaves,
        modules={},
        handler=handler_of(item),
        ocdbt=bool(ocp.type_handlers.is_ocdbt_checkpoint(item)),
        zarr3=bool(getattr(metadata, "use_zarr3", False)),
        unread=unread,
    )


def _record(name: str, path: str, m: Any) -> tuple[LeafMetadata | None, str]:
    """The leaf record of one entry of Orbax's metadata tree, and why it
    cannot be read ("" if it can)."""
    shape = getattr(m, "shape", None)
    dtype = getattr(m, "dtype", None)
    if isinstance(m, ocp.metadata.StringMetadata):
        return None, "a string (Orbax keeps strings apart): not an array"
    if shape is None or dtype is None:
        return None, ""  # an empty node, None: nothing stored
    try:
        shape = tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        return None, f"Orbax's metadata gives no usable shape and dtype ({m!r:.80})"
    if any(d < 0 for d in shape) or dtype.kind not in _DTYPE_KINDS:
        return None, f"shape {shape} or dtype {dtype} is no array the tools read"
    storage = getattr(m, "name", None)
    if not isinstance(storage, str) or not _safe_name(storage):
        return None, (
            f"Orbax names its data {storage!r}, which is no name inside the "
            "checkpoint's directory"
        )
    sharding = sharding_text(getattr(m, "sharding", None))
    scalar = isinstance(m, ocp.metadata.ScalarMetadata)
    record = LeafMetadata(
        name,
        path,
        ARRAY,
        shape=shape,
        dtype=str(dtype),
        container=PYTHON if scalar else (JAX if sharding else NUMPY),
        data=STORED,
        nbytes=math.prod(shape) * dtype.itemsize,
        sharding=sharding or None,
        key=storage,
    )
    return record, ""


def _safe_name(name: str) -> bool:
    return bool(_STORAGE_NAME.fullmatch(name)) and not any(
        part in (".", "..") for part in name.split("/")
    )


def _check_names(item: epath.Path, text: bytes) -> None:
    """Refuses an item whose `_METADATA` names an array outside the item.

    Orbax names each array by its keys joined with `.`, and opens its files
    at that name under the item (its public `metadata()` does, before any
    check of ours could run): a key `/etc` or `..` would have it read
    elsewhere. Only a `_METADATA` of the layout Orbax 0.12 writes is checked;
    anything else is left to Orbax, which refuses what it cannot parse.
    """
    try:
        tree = json.loads(text).get("tree_metadata")
    except (ValueError, AttributeError, RecursionError):
        return
    if not isinstance(tree, dict):
        return
    bad = []
    for entry in tree.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list):
            continue
        found = [k.get("key") for k in keys if isinstance(k, dict)]
        parts = [p for p in found if isinstance(p, str)]
        if len(parts) == len(found) and not _safe_name(".".join(parts)):
            bad.append(repr(".".join(parts)))
    if bad:
        raise CheckpointDamagedError(
            f"{item / PLAIN_METADATA} names arrays outside the checkpoint's "
            f"directory ({inline_list(bad)}): Orbax would read their files "
            "there. It is no checkpoint Orbax writes; it is not read."
        )


def handler_of(item: epath.Path) -> str | None:
    """The handler that wrote `item`, as Orbax's `_CHECKPOINT_METADATA` records
    it: in the item (a checkpointer's save) or in its step (a manager's, or
    `ocp.v1`'s, by item name). None if neither says."""
    for where, key in ((item, None), (item.parent, item.name)):
        recorded = _json(where / CHECKPOINT_METADATA)
        handlers = recorded.get("item_handlers") if isinstance(recorded, dict) else None
        if key is not None and isinstance(handlers, dict):
            handlers = handlers.get(key)
        if isinstance(handlers, str) and _is_handler_name(handlers):
            return handlers
    return None


def handlers_in(step: epath.Path) -> dict[str, str]:
    """`{item name: handler}` as the step's `_CHECKPOINT_METADATA` records them."""
    recorded = _json(step / CHECKPOINT_METADATA)
    handlers = recorded.get("item_handlers") if isinstance(recorded, dict) else None
    if not isinstance(handlers, dict):
        return {}
    return {
        k: v
        for k, v in handlers.items()
        if isinstance(k, str) and isinstance(v, str) and _is_handler_name(v)
    }


def _is_handler_name(text: str) -> bool:
    return len(text) <= _HANDLER_MAX and bool(_HANDLER_NAME.fullmatch(text))


def _json(path: epath.Path) -> Any:
    # A nicety: a missing, odd or oversized file says nothing.
    try:
        return json.loads(read_bounded(path, _SMALL_JSON_MAX))
    except (OSError, ValueError, RecursionError, OrbaxEqxError):
        return None


def _check_size(path: epath.Path, limit: int) -> None:
    try:
        size = path.stat().length
    except (OSError, AttributeError):
        return  # missing: Orbax's read says so
    if size > limit:
        raise CheckpointDamagedError(
            f"{path} has {size} bytes, more than the {limit} that Orbax's metadata "
            "of any checkpoint needs: the checkpoint is damaged, or not one; it "
            "is not read."
        )


def sharding_text(sharding: Any) -> str:
    """Orbax's sharding metadata as text: `single device (cpu:0)`,
    `P('data', None) over data=8`, `replicated over data=8`; "" for None."""
    if sharding is None:
        return ""
    device = getattr(sharding, "device_str", None)
    if device is not None:
        return f"single device ({device})"
    spec = getattr(sharding, "partition_spec", None)
    axes = getattr(sharding, "axis_names", None)
    shape = getattr(sharding, "shape", None)
    if spec is None or axes is None or shape is None:
        return type(sharding).__name__
    mesh = ", ".join(f"{a}={int(n)}" for a, n in zip(axes, list(shape), strict=False))
    if all(p is None or p == [] for p in spec):
        return f"replicated over {mesh}"
    parts = ", ".join(repr(tuple(p)) if isinstance(p, list) else repr(p) for p in spec)
    return f"P({parts}) over {mesh}"


# --- restoring into a skeleton ------------------------------------------------


def restore(path: epath.Path, args) -> Any:
    """Restores the plain Orbax checkpoint at `path` into `args.skeleton`."""
    _check_asked(path, args)

    def cannot(e: Exception) -> CheckpointDamagedError:
        # `json.JSONDecodeError` is a ValueError; the rest: JSON of other shapes.
        return CheckpointDamagedError(
            f"{path / PLAIN_METADATA}, Orbax's record of the arrays of this plain "
            f"Orbax checkpoint, cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): the checkpoint is "
            "damaged (or something else was put in its place). Restore an "
            "earlier step."
        )

    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = _orbax_metadata(handler, path, cannot)
        tree = getattr(tree, "tree", tree)
        entries = {_key(p): (p, m) for p, m in jtu.tree_flatten_with_path(tree)[0]}
        walked = walk(args.skeleton)
        saved, orbax_of = _records(path, walked, entries)
        kept = {leaf.name for leaf in _checked(path, walked, saved, args)}
        shardings = resolve(args.shardings, walked)
        wanted = {
            orbax_of[leaf.name]: leaf
            for leaf in walked.leaves
            if leaf.name in orbax_of and leaf.name not in kept
        }
        restore_args = jtu.tree_map_with_path(
            lambda p, m: _restore_args(wanted.get(_key(p)), shardings, args.cast),
            tree,
        )
        read = handler.restore(
            path, args=ocp.args.PyTreeRestore(restore_args=restore_args)
        )
    finally:
        handler.close()
    values_read = {_key(p): x for p, x in jtu.tree_flatten_with_path(read)[0]}
    values = []
    for leaf in walked.leaves:
        key = orbax_of.get(leaf.name)
        if leaf.name in kept or key is None:
            values.append(leaf.value)  # from the skeleton
        else:
            values.append(_finish(values_read[key], leaf))
    return jtu.tree_unflatten(walked.treedef, values)


def _check_asked(path: epath.Path, args) -> None:
    """A plain Orbax checkpoint restores into a skeleton, with the options
    that need no sidecar; anything else is refused, saying why."""
    asked = [
        f"{name}={getattr(args, name)!r}"
        for name, default in _UNSUPPORTED.items()
        if getattr(args, name) != default
    ]
    if args.allow is not None:
        asked.append(f"allow={list(args.allow)!r}")
    if args.skeleton is None or asked:
        head = (
            f"{path} is a plain Orbax checkpoint (no orbax_eqx sidecar): it holds "
            "arrays only, with no classes or static fields, so it restores into a "
            "skeleton only"
        )
        # What is missing to rebuild or name leaves is the sidecar.
        error = RebuildError if args.allow is not None else SidecarError
        if asked:
            raise error(
                f"{head}, with `shardings=`, `cast=`, `strict=`, `missing=`; not "
                f"with {', '.join(asked)}."
            )
        raise error(
            f"{head}. Pass the skeleton of the model, usually "
            "`eqx.filter_eval_shape(make_model, key)`."
        )


def _checked(path: epath.Path, walked, saved, args) -> list:
    """The skeleton's leaves kept as they are (`check`), the differences
    raised in words for a plain Orbax checkpoint."""
    try:
        return check(
            walked,
            saved,
            cast=args.cast,
            strict=args.strict,
            on_static_mismatch=args.on_static_mismatch,
            missing=args.missing,
        )
    except CheckpointMismatchError as e:
        # `inspect` reads sidecars; Orbax's own metadata is what there is.
        text = str(e).replace(
            f"see `python -m orbax_eqx inspect {path}`",
            "`ocp.PyTreeCheckpointHandler().metadata(path)` lists the saved shapes",
        )
        raise CheckpointMismatchError(text) from None


def _key(path: tuple) -> tuple[str, ...]:
    """A key path as Orbax names it: the text of each key."""
    parts = []
    for k in path:
        if isinstance(k, jtu.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jtu.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, (jtu.DictKey, jtu.FlattenedIndexKey)):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return tuple(parts)


def _records(path, walked, entries) -> tuple[Metadata, dict[str, tuple]]:
    """A sidecar for the plain checkpoint, as the skeleton sees it: its arrays
    under the skeleton's leaf names, and the skeleton's own Python leaves,
    classes and static fields (which the checkpoint does not hold)."""
    leaves: dict[str, LeafMetadata] = {}
    orbax_of: dict[str, tuple] = {}
    for leaf in walked.leaves:
        key = _key(leaf.path)
        entry = entries.get(key)
        if entry is not None and (leaf.kind == ARRAY or leaf.kind == SCALAR):
            _, m = entry
            orbax_of[leaf.name] = key
            # A Python value saved by Orbax (as a scalar) restores as one.
            scalar = leaf.kind == SCALAR and tuple(m.shape) == ()
            kind = SCALAR if scalar else ARRAY
            leaves[leaf.name] = LeafMetadata(
                leaf.name,
                leaf.path_str,
                kind,
                shape=tuple(m.shape),
                dtype=str(np.dtype(m.dtype)),
                container=JAX if kind == ARRAY else None,
                data=STORED,
                value=encode(leaf.value) if kind == SCALAR else None,
                nbytes=0,
            )
        elif leaf.kind != ARRAY and entry is None:
            leaves[leaf.name] = LeafMetadata(
                leaf.name, leaf.path_str, leaf.kind, value=encode(leaf.value)
            )
    used = set(orbax_of.values())
    for key, (p, m) in entries.items():
        if key not in used:  # in the checkpoint, not in the skeleton
            name = join([key_part(jtu.DictKey(k)) for k in key])
            leaves.setdefault(
                name,
                LeafMetadata(
                    name,
                    jtu.keystr(p),
                    ARRAY,
                    shape=tuple(m.shape),
                    dtype=str(np.dtype(m.dtype)),
                    container=JAX,
                    data=STORED,
                ),
            )
    modules = dict(walked.modules)  # the skeleton's: nothing to compare with
    return Metadata(str(path), 0, {}, leaves, modules), orbax_of


def _restore_args(leaf, shardings, cast: bool) -> Any:
    if leaf is None or leaf.kind != ARRAY:  # not wanted, or a Python value
        return ocp.RestoreArgs(restore_type=np.ndarray)
    x = leaf.value
    dtype = x.dtype if cast else None
    if container(x) != JAX:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
    sharding = shardings.get(leaf.name)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return ocp.ArrayRestoreArgs(
        sharding=sharding, global_shape=tuple(x.shape), dtype=dtype
    )


def _finish(value: Any, leaf) -> Any:
    if leaf.kind == SCALAR:
        return type(leaf.value)(np.asarray(value).item())
    if container(leaf.value) == NUMPY_SCALAR:
        return np.asarray(value)[()]
    return value


# --- reading arrays a block at a time -----------------------------------------


class StoreReader:
    """Reads arrays of one Orbax array store by their Orbax names, through
    TensorStore specs that Orbax's public `get_json_tspec_read` builds, with
    missing chunks an error rather than zeros.

    **Arguments:**

    - `directory`: the store (a plain item's directory, or an orbax_eqx
        item's `orbax_eqx~arrays.<token>`).
    - `ocdbt`, `zarr3`: its layout; None: found out from the files (OCDBT
        from Orbax's own test, zarr3 by trying it where zarr fails).
    """

    def __init__(
        self,
        directory: epath.Path,
        ocdbt: bool | None = None,
        zarr3: bool | None = None,
    ):
        self.directory = directory
        if ocdbt is None:
            ocdbt = bool(ocp.type_handlers.is_ocdbt_checkpoint(directory))
        self.ocdbt = ocdbt
        self.zarr3 = zarr3
        # Orbax's context, with a smaller cache for OCDBT's b-tree nodes:
        # Orbax's 100 MB would be held on top of the blocks being read.
        spec = ocp.type_handlers.get_ts_context().spec.to_json()
        spec["cache_pool#ocdbt"] = {"total_bytes_limit": _OCDBT_CACHE}
        self._context = ts.Context(spec)

    def open(self, record: LeafMetadata) -> ts.TensorStore:
        """Opens the array of `record` (by `record.key`), checked against it."""
        tries = [self.zarr3] if self.zarr3 is not None else [False, True]
        error: Exception | None = None
        for zarr3 in tries:
            info = ocp.type_handlers.ParamInfo(
                name=record.key,
                parent_dir=self.directory,
                is_ocdbt_checkpoint=self.ocdbt,
                use_zarr3=zarr3,
                ts_context=self._context,
            )
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.ocdbt)
            spec["fill_missing_data_reads"] = False  # a lost chunk is no zeros
            try:
                store = ts.open(
                    spec, open=True, read=True, context=self._context
                ).result(timeout=TIMEOUT)
            except Exception as e:  # TensorStore's: NOT_FOUND, DATA_LOSS...
                error = e
                continue
            self._check(record, store)
            return store
        raise _unreadable(record, self.directory, error)

    def _check(self, record: LeafMetadata, store: ts.TensorStore) -> None:
        shape = tuple(int(d) for d in store.shape)
        dtype = np.dtype(store.dtype.numpy_dtype)
        if shape != tuple(record.shape or ()) or str(dtype) != record.dtype:
            raise _damaged(
                record,
                f"the metadata says shape {tuple(record.shape or ())} and dtype "
                f"{record.dtype}, its array in {self.directory} has {shape} and "
                f"{dtype}: the checkpoint is damaged or mixed from two saves",
            )
        chunk = _chunk_shape(store)
        nbytes = math.prod(chunk) * dtype.itemsize
        if nbytes > max_chunk():
            raise _damaged(
                record,
                f"is stored in chunks of {chunk} ({nbytes} bytes), more than half "
                "of this machine's memory: reading one would not fit; read it on "
                "a larger machine",
            )

    def blocks(self, record: LeafMetadata, budget: int) -> Iterator[np.ndarray]:
        """Yields the array of `record` in blocks of whole chunks, in no
        particular order, each about `budget` bytes (or one chunk, if larger)."""
        store = self.open(record)
        shape = tuple(int(d) for d in store.shape)
        if math.prod(shape) == 0:
            return
        block = _block_shape(
            shape, _chunk_shape(store), store.dtype.numpy_dtype, min(budget, MAX_BLOCK)
        )
        ranges = [range(0, n, b) for n, b in zip(shape, block, strict=True)]
        for start in itertools.product(*ranges):
            box = tuple(
                slice(a, min(a + b, n))
                for a, b, n in zip(start, block, shape, strict=True)
            )
            try:
                data = store[box].read().result(timeout=TIMEOUT)
            except Exception as e:
                raise _unreadable(record, self.directory, e) from e
            yield np.asarray(data)
            del data

    def read(self, record: LeafMetadata) -> np.ndarray:
        """The whole array of `record`."""
        store = self.open(record)
        try:
            return np.asarray(store.read().result(timeout=TIMEOUT))
        except Exception as e:
            raise _unreadable(record, self.directory, e) from e

    def stream(
        self, records: Iterable[LeafMetadata], budget: int
    ) -> Iterator[tuple[LeafMetadata, np.ndarray]]:
        """Yields `(record, array)` in order, holding about `budget` bytes at
        most (as `LeafReader.stream` does)."""
        for batch in batches(records, max(budget // 2, 1)):
            for record in batch:
                yield record, self.read(record)
            release_memory()

    def close(self) -> None:
        pass

    def __enter__(self) -> "StoreReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def max_chunk() -> int:
    """The largest chunk read: half of this machine's memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _chunk_shape(store: ts.TensorStore) -> tuple[int, ...]:
    shape = tuple(int(d) for d in store.shape)
    chunk = store.chunk_layout.read_chunk.shape
    if chunk is None:
        return shape
    return tuple(
        max(1, min(int(c), n)) if c else max(n, 1)
        for c, n in zip(chunk, shape, strict=False)
    )


def _block_shape(shape, chunk, dtype, budget: int) -> tuple[int, ...]:
    """Whole chunks, grown along the leading axes while within `budget`."""
    block = list(chunk)
    itemsize = np.dtype(dtype).itemsize
    for axis in range(len(shape)):
        others = math.prod(block) // max(block[axis], 1) * itemsize
        fit = max(budget // max(others, 1), 1)
        grown = max(fit // chunk[axis], 1) * chunk[axis]
        block[axis] = min(max(grown, chunk[axis]), max(shape[axis], 1))
        if block[axis] < shape[axis]:
            break  # the block is full: the axes after it stay one chunk
    return tuple(block)


class UnreadableArray(CheckpointDamagedError):
    """An array of Orbax's store that cannot be read; `problem` says why."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


def _damaged(record: LeafMetadata, problem: str) -> UnreadableArray:
    return UnreadableArray(f"Leaf `{record.path}` ({record.name}): {problem}.", problem)


def _unreadable(record: LeafMetadata, directory, error) -> UnreadableArray:
    return _damaged(
        record,
        f"cannot be read from Orbax's array store at {directory}: "
        + tensorstore_text(error),
    )


def without_specs(text: str) -> str:
    """`text` without the specs and source locations TensorStore appends."""
    return _APPENDED.sub("", text)


def tensorstore_text(error: BaseException | None) -> str:
    """The first line of a TensorStore (or Orbax) error, without the spec it
    appends, cut to its start and its end (which says what was wrong)."""
    text = without_specs(str(error or "")).strip()
    line = text.splitlines()[0] if text else repr(error)
    half = (_MAX_TEXT - 5) // 2
    return line if len(line) <= _MAX_TEXT else f"{line[:half]} ... {line[-half:]}"
