"""Plain Orbax checkpoints as `verify` and the command line see them: what
they hold, from Orbax's metadata.

A plain Orbax item is one that Orbax's own PyTree handlers wrote
(`PyTreeCheckpointHandler`, `StandardCheckpointHandler`, `ocp.v1.save_pytree`;
with OCDBT or not, zarr v2 or v3): an `_METADATA` file and an array store, no
sidecar. Its arrays are listed from Orbax's public
`PyTreeCheckpointHandler().metadata(path)` (names, shapes, dtypes, the
sharding each was saved with), and the handler that wrote it from the
`_CHECKPOINT_METADATA` file Orbax writes beside it. Nothing is read from the
arrays here; `store_read` reads them.

A plain checkpoint may come from anywhere: before Orbax reads it, its files
are checked to be regular files (`_storage/orbax_store/files.py`), its
`_METADATA` to be of a sane size, and every name Orbax will use as a storage
key to stay inside the item.
"""

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax.tree_util as jtu
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .._bytes.route import read_bounded
from .._errors import CheckpointDamagedError, OrbaxEqxError, inline_list
from .._format.locate import PLAIN_METADATA, is_plain_item
from .._format.sidecar import STORED, LeafMetadata, Metadata
from .._storage.orbax_store.files import check as check_store_files
from .._tree.names import join, key_part
from .._tree.walk import ARRAY, JAX, NUMPY
from .store_read import tensorstore_text

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


is_plain = is_plain_item


class PlainCheckpointError(OrbaxEqxError, ValueError):
    """A plain Orbax checkpoint whose metadata cannot be read."""


@dataclasses.dataclass(frozen=True)
class PlainMetadata(Metadata):
    """A plain Orbax item as the tools see it: every array as a leaf stored in
    Orbax's array store (`data="orbax"`, `key` Orbax's own name for it), with
    no modules, no classes and no Python values.

    - `handler`: the handler that wrote it, as Orbax recorded it (its type
        name, such as `...StandardCheckpointHandler`), or None.
    - `ocdbt`, `zarr3`: how its array store is laid out.
    - `unread`: leaves Orbax's metadata lists that are no array the tools
        read (strings, odd dtypes, unsafe names): `{name: why}`; they are not
        in `leaves`.

    A jax array's leaf has `container="jax"` and the sharding Orbax recorded
    (as text) in `sharding`; a numpy array's `"numpy"`; a Python scalar's
    `"python"`.
    """

    handler: str | None = None
    ocdbt: bool = False
    zarr3: bool = False
    unread: dict[str, str] = dataclasses.field(default_factory=dict)


def read(item: epath.Path) -> PlainMetadata:
    """What the plain Orbax item at `item` holds, from Orbax's metadata.

    Raises `CheckpointDamagedError` if its files are not regular files or its
    `_METADATA` is too large, `PlainCheckpointError` if Orbax cannot read it.
    """
    check_store_files(item)  # Orbax's reads would block on a FIFO there
    _check_size(item / PLAIN_METADATA, _METADATA_MAX)
    try:
        _check_names(item, read_bounded(item / PLAIN_METADATA, _METADATA_MAX))
    except FileNotFoundError:
        pass  # Orbax's read says so
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(item)
    except OrbaxEqxError:
        raise
    except Exception as e:  # Orbax's and TensorStore's errors, whatever they are
        raise PlainCheckpointError(
            f"{item} looks like a plain Orbax checkpoint (it has {PLAIN_METADATA}), "
            f"but Orbax cannot read its metadata: {tensorstore_text(e)}. The "
            "checkpoint is damaged or incomplete; use another step."
        ) from e
    finally:
        handler.close()
    tree = getattr(metadata, "tree", metadata)
    flat, _ = jtu.tree_flatten_with_path(tree)
    leaves: dict[str, LeafMetadata] = {}
    unread: dict[str, str] = {}
    for path, m in flat:
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
    container = PYTHON if scalar else (JAX if sharding else NUMPY)
    record = LeafMetadata(
        name,
        path,
        ARRAY,
        shape=shape,
        dtype=str(dtype),
        container=container,
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
        if len(parts) == len(found):
            name = ".".join(parts)
            if not _safe_name(name):
                bad.append(repr(name))
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
