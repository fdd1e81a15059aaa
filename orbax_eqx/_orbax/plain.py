"""Plain Orbax checkpoints of Equinox models, restored into a skeleton.

The usual recipe before orbax_eqx saves the arrays of a model with Orbax's
own handlers: `ocp.StandardCheckpointer().save(path, eqx.filter(model,
eqx.is_array))` (or `PyTreeCheckpointer`, or `StandardSave`/`PyTreeSave`
under a `CheckpointManager`). Such a checkpoint holds arrays by key path and
nothing else: not the classes, static fields, callables or Python values,
which all come from the skeleton. Its arrays are matched to the skeleton's
array leaves by key path (an attribute, an index, a dict key: Orbax names
each by its text), checked with the same all-differences message as an
orbax_eqx checkpoint, and read by Orbax.
"""

from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .._errors import (
    CheckpointDamagedError,
    CheckpointMismatchError,
    RebuildError,
    SidecarError,
)
from .._format.locate import is_plain_item
from .._format.sidecar import STORED, LeafMetadata, Metadata
from .._restore.check import check
from .._restore.shardings import resolve
from .._storage.orbax_store import files as _store_files
from .._tree.names import join, key_part
from .._tree.values import encode
from .._tree.walk import ARRAY, JAX, NUMPY_SCALAR, SCALAR, container, walk

is_plain = is_plain_item  # whether `path` is an item Orbax's PyTree handlers saved


# Options of `EqxRestore` that a plain checkpoint can honour, with their defaults
# for the rest (which act on names and records it does not have).
_UNSUPPORTED = {"prefix": None, "renames": None, "report": False}


def restore(path: epath.Path, args) -> Any:
    """Restores the plain Orbax checkpoint at `path` into `args.skeleton`."""
    _check_asked(path, args)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree_metadata = _tree_metadata(handler, path)
        entries = {
            _key(p): (p, m) for p, m in jtu.tree_flatten_with_path(tree_metadata)[0]
        }
        walked = walk(args.skeleton)
        saved, orbax_of = _records(path, walked, entries)
        kept = _checked(path, walked, saved, args)
        kept_names = {leaf.name for leaf in kept}
        shardings = resolve(args.shardings, walked)
        wanted = {
            orbax_of[leaf.name]: leaf
            for leaf in walked.leaves
            if leaf.name in orbax_of and leaf.name not in kept_names
        }
        restore_args = jtu.tree_map_with_path(
            lambda p, m: _restore_args(wanted.get(_key(p)), shardings, args.cast),
            tree_metadata,
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
        if leaf.name in kept_names or key is None:
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


def _tree_metadata(handler, path: epath.Path) -> Any:
    """Orbax's record of the checkpoint's arrays (its `_METADATA`), read by
    Orbax; a file Orbax cannot read is damage, said as ours."""
    _store_files.check(path)  # Orbax's reads would block on a FIFO there
    try:
        found = handler.metadata(path)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        # `json.JSONDecodeError` is a ValueError; the rest: JSON of other shapes.
        raise CheckpointDamagedError(
            f"{path / '_METADATA'}, Orbax's record of the arrays of this plain "
            f"Orbax checkpoint, cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): the checkpoint is "
            "damaged (or something else was put in its place). Restore an "
            "earlier step."
        ) from None
    return getattr(found, "tree", found)


def _key(path: tuple) -> tuple[str, ...]:
    """A key path as Orbax names it: the text of each key."""
    parts = []
    for k in path:
        if isinstance(k, jtu.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jtu.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jtu.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jtu.FlattenedIndexKey):
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
