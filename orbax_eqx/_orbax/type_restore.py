"""Restoring what `PackedArrayHandler` saved: restore args checked against
the group indexes, every problem at once, then reads planned and done.

`ArrayRestoreArgs` are honoured as Orbax's own `ArrayHandler` does: `sharding`
(a `Sharding`, Orbax's `ShardingMetadata`, a `Format`'s sharding, or `mesh`
with `mesh_axes`), else the saved sharding if this process can rebuild it;
`dtype` (a cast, on host); `global_shape` (with `strict=False`, truncated or
zero-padded along the same dimensions).
"""

from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np
import orbax.checkpoint as ocp

from .._errors import (
    EARLIER_STEP,
    CheckpointDamagedError,
    CheckpointMismatchError,
    bullet_list,
    problem,
)
from .._storage.typed import read as _typed
from .._tree.names import label
from .._tree.walk import JAX, NUMPY, is_key_dtype, parse_dtype

# The shardings Orbax has metadata for, by the name the index stores.
SHARDING_METADATA: dict[str, tuple[type[jax.sharding.Sharding], Any]] = {
    "NamedSharding": (
        jax.sharding.NamedSharding,
        ocp.metadata.NamedShardingMetadata,
    ),
    "SingleDeviceSharding": (
        jax.sharding.SingleDeviceSharding,
        ocp.metadata.SingleDeviceShardingMetadata,
    ),
}


def leaf_path(info) -> str:
    """The leaf path for messages: `['params']['w']`, else the leaf name."""
    if info.keypath is not None:
        try:
            return jtu.keystr(tuple(info.keypath))
        except (TypeError, ValueError):
            pass
    return info.name


def leaf_label(info) -> str:
    """How messages name the leaf: Orbax's name for it, with the leaf path
    beside it where that adds something (see `names.label`)."""
    return label(info.name, leaf_path(info))


def sharding_metadata(stored: Any) -> Any:
    """The stored sharding as Orbax's `ShardingMetadata`, or None."""
    if not isinstance(stored, dict) or stored.get("class") not in SHARDING_METADATA:
        return None
    try:
        return SHARDING_METADATA[stored["class"]][1].from_deserialized_dict(
            stored["metadata"]
        )
    except Exception:  # a damaged entry: as if none was saved
        return None


def check_listed(directory, groups, infos) -> None:
    missing = [leaf_label(i) for i in infos if i.name not in groups]
    if missing:
        found = ", ".join(sorted({g.directory.name for g in groups.values()}))
        raise problem(
            CheckpointDamagedError,
            f"No index of arrays saved with orbax_eqx's type handler in "
            f"{directory} lists these leaves (it has {found}):\n"
            + bullet_list([f"Leaf {p}" for p in missing])
            + "\nThe checkpoint is damaged, or they were saved by another handler "
            "into the same directory.",
            file=directory,
            leaves=[i.name for i in infos if i.name not in groups],
            remedy=EARLIER_STEP,
        )


def array_metadata(directory, groups, infos) -> list[ocp.metadata.ArrayMetadata]:
    """Orbax's metadata of each leaf: shape, dtype and saved sharding."""
    check_listed(directory, groups, infos)
    result = []
    for info in infos:
        group = groups[info.name]
        record = group.saved.leaves[info.name]
        result.append(
            ocp.metadata.ArrayMetadata(
                name=info.name,
                directory=directory,
                shape=record.shape,
                sharding=sharding_metadata(group.shardings.get(info.name)),
                dtype=parse_dtype(record.dtype),
            )
        )
    return result


class _Plan(NamedTuple):
    """How one leaf is read: a request of its group, and an optional resize."""

    name: str
    group: Any
    request: Any
    resize_to: tuple[int, ...] | None = None  # a new global shape (`strict=False`)
    sharding: Any = None  # where the resized array goes


def plan(directory, groups, infos, args, *, numpy: bool = False) -> list[_Plan]:
    """Checks every leaf's restore args against its record, then plans reads:
    onto jax arrays, or with `numpy` (`restore_type=np.ndarray`) to numpy.

    Every problem is reported at once, before any array byte is read.
    """
    check_listed(directory, groups, infos)
    problems: list[str] = []
    fixes: dict[str, None] = {}  # in order, once each
    plans = []
    for info, arg in zip(infos, args, strict=True):
        group = groups[info.name]
        found = _plan_one(info, arg, group, numpy)
        if isinstance(found, _Plan):
            plans.append(found)
        else:
            problems.append(found[0])
            fixes[found[1]] = None
    if problems:
        raise CheckpointMismatchError(
            f"Cannot restore these leaves from the checkpoint in {directory}:\n"
            + bullet_list(problems)
            + "\n"
            + " ".join(fixes)
        )
    return plans


_KEYS_AS_KEYS = (
    "Typed PRNG keys restore as the keys they are: ask for their saved dtype."
)
_KEYS_AS_JAX = "Typed PRNG keys restore as jax arrays only: ask for `jax.Array`."
_SHARDINGS = (
    "Give each jax array a sharding of this process's devices: "
    "`ArrayRestoreArgs(sharding=...)`, or a target leaf with one "
    "(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`)."
)
_SHAPES = (
    "Restore into a target of the saved shape (`metadata()` lists them); to "
    "truncate or zero-pad along the same dimensions, pass "
    "`ArrayRestoreArgs(..., strict=False)` (`StandardRestore(..., strict=False)`)."
)
_KEY_SHAPES = "Typed PRNG keys cannot be truncated or padded."


def _plan_one(info, arg, group, numpy: bool) -> "_Plan | tuple[str, str]":
    """One leaf's plan, or `(problem, fix)`."""
    record = group.saved.leaves[info.name]
    path = leaf_label(info)
    saved = parse_dtype(record.dtype)
    key = is_key_dtype(saved)
    dtype = _dtype(getattr(arg, "dtype", None), saved, record.dtype, path)
    if isinstance(dtype, tuple):
        return dtype
    if key and numpy:
        return f"Leaf {path} holds typed PRNG keys; the restore asks for numpy.", (
            _KEYS_AS_JAX
        )
    sharding = None
    if not numpy:
        sharding = _target_sharding(arg, group.shardings.get(info.name))
        if isinstance(sharding, str):
            return f"Leaf {path} has no target sharding: {sharding}.", _SHARDINGS
    shape = getattr(arg, "global_shape", None)
    shape = record.shape if shape is None else tuple(shape)
    if shape == record.shape:
        request = _typed.Request(record, dtype, NUMPY if numpy else JAX, sharding)
        return _Plan(info.name, group, request)
    if getattr(arg, "strict", True) or len(shape) != len(record.shape):
        return (
            f"Leaf {path} has shape {record.shape} in the checkpoint; the "
            f"restore asks for {shape}.",
            _SHAPES,
        )
    if key:
        return (
            f"Leaf {path} holds typed PRNG keys of shape {record.shape}; the "
            f"restore asks for {shape}.",
            _KEY_SHAPES,
        )
    request = _typed.Request(record, dtype, NUMPY, None)
    return _Plan(info.name, group, request, shape, sharding)


def _dtype(dtype: Any, saved: Any, text: str, path: str) -> Any:
    """The dtype a leaf restores as, asked (`dtype`, None if not) of one saved
    as `saved` (`text`), or `(problem, fix)`: typed PRNG keys restore as
    keys of their saved dtype only."""
    key = is_key_dtype(saved)
    if dtype is None or key and str(dtype) == str(saved):
        return saved
    if key or is_key_dtype(dtype):
        asked = dtype if is_key_dtype(dtype) else np.dtype(dtype)
        return (
            f"Leaf {path} is {text} in the checkpoint; the restore asks for {asked}.",
            _KEYS_AS_KEYS,
        )
    return np.dtype(dtype)


def _target_sharding(arg: Any, stored: Any) -> Any:
    """The sharding a leaf goes to, or a string saying why there is none."""
    mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
    if mesh is not None and axes is not None:
        return jax.sharding.NamedSharding(mesh, axes)
    sharding = getattr(arg, "sharding", None)
    if isinstance(sharding, ocp.metadata.ShardingMetadata):
        try:
            return sharding.to_jax_sharding()
        except Exception:  # Orbax's reasons name every device: too long per leaf
            return (
                f"the one given, {sharding!r}, cannot be rebuilt on this "
                f"process's {jax.device_count()} device(s)"
            )
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        sharding = getattr(sharding, "sharding", None)  # a `Format`: its sharding
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    meta = sharding_metadata(stored)
    if meta is None:
        return "none was given, and none was saved"
    try:
        return meta.to_jax_sharding()
    except Exception:  # Orbax's reasons name every device: too long per leaf
        return (
            f"none was given, and the saved one ({stored.get('text')}) cannot be "
            f"rebuilt on this process's {jax.device_count()} device(s)"
        )


def read(plans: list[_Plan], verify: bool) -> list[Any]:
    by_group: dict[int, list[_Plan]] = {}
    for plan in plans:
        by_group.setdefault(id(plan.group), []).append(plan)
    out: dict[str, Any] = {}
    for batch in by_group.values():
        requests = {p.name: p.request for p in batch}
        out.update(_typed.read(batch[0].group, requests, verify=verify))
    for plan in plans:
        if plan.resize_to is not None:
            out[plan.name] = _resized(out[plan.name], plan.resize_to, plan.sharding)
    return [out[p.name] for p in plans]


def _resized(host: np.ndarray, shape: tuple[int, ...], sharding) -> Any:
    """`host` truncated or zero-padded to `shape`, placed on `sharding` (if any)."""
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(host.shape, shape, strict=False))
    out[common] = host[common]
    if sharding is None:
        return out
    return jax.make_array_from_callback(shape, sharding, lambda i: out[i])
