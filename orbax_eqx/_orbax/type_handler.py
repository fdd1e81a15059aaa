"""`PackedArrayHandler`: an Orbax `TypeHandler` that stores jax arrays in packs.

For users of Orbax's own handlers (`ocp.PyTreeCheckpointHandler`,
`ocp.StandardCheckpointHandler`): Orbax hands a `TypeHandler` all the leaves of
its type in one `serialize` call, so they can be written as one group of
files (see `_storage/typed.py`) instead of one stored array each: fully
replicated arrays into one pack, sharded ones into a shard pack per process.
Registered in a local registry (`type_registry`), never in Orbax's global one.
"""

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
import orbax.checkpoint as ocp

from .._errors import (
    CheckpointDamagedError,
    CheckpointMismatchError,
    HostLocalArrayError,
    OrbaxEqxError,
    UnsupportedLeafError,
    bullet_list,
)
from .._storage import typed as _typed
from .._storage.shards import describe
from .._tree.walk import JAX, NUMPY, is_key_dtype, parse_dtype

# Pinned: checkpoints record it for every leaf this handler saved, and Orbax
# finds the handler to restore them by it.
TYPESTR = "orbax_eqx.PackedArray"


class TypeHandlerOptionError(OrbaxEqxError, ValueError):
    """Options that the pack's type handler cannot work with."""


# The shardings Orbax has metadata for, by the name the index stores.
_SHARDING_METADATA = {
    "NamedSharding": (
        jax.sharding.NamedSharding,
        ocp.metadata.NamedShardingMetadata,
    ),
    "SingleDeviceSharding": (
        jax.sharding.SingleDeviceSharding,
        ocp.metadata.SingleDeviceShardingMetadata,
    ),
}


class PackedArrayHandler(ocp.type_handlers.TypeHandler):
    """Saves the jax arrays of one Orbax save in packs, at disk speed.

    Fully replicated arrays (on one device, or a copy on every device) go end
    to end into one pack file, written by the primary host; sharded arrays go
    to shard packs: each process writes the distinct shards it holds into a
    file of its own, with an index of chunk boxes. A restore onto any
    sharding, mesh or device count reads just the byte ranges each device
    needs, checked against CRC-32s recorded at save. No computation runs on a
    device; processes meet only at Orbax's own barrier before the commit.

    Checkpoints of Orbax's own `ArrayHandler` (saved before switching) still
    restore: this handler hands them to it.

    Use it through `oeqx.type_handler_registry()`, which leaves Orbax's global
    handler for `jax.Array` alone.

    **Arguments:**

    - `primary_host`: the process that writes the pack and the index; the same
        as `MultiprocessingOptions(primary_host=...)` of the checkpoint handler.
    - `verify`: check every byte read against its recorded CRC-32 (a mismatch
        is a `CheckpointDamagedError` naming the leaf).
    """

    # Orbax looks for an array metadata store on the handler of `jax.Array`,
    # and logs a warning at every handler's construction if there is none.
    # This handler keeps shapes, dtypes and shardings in its own index.
    _array_metadata_store = None

    def __init__(self, *, primary_host: int = 0, verify: bool = True):
        if type(primary_host) is not int or primary_host < 0:
            raise TypeHandlerOptionError(
                f"PackedArrayHandler(primary_host={primary_host!r}): expected the "
                "index of the process that writes the pack and the index (an int, "
                "usually 0). Orbax's `primary_host=None` (every process writes its "
                "own copy) is not supported; use Orbax's own ArrayHandler for it."
            )
        self._primary_host = primary_host
        self._verify = verify

    def typestr(self) -> str:
        return TYPESTR

    async def serialize(
        self,
        values: Sequence[jax.Array],
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.SaveArgs] | None = None,
    ) -> list[ocp.future.Future]:
        """Copies this process's part of `values` to host; returns the writes.

        The copies are taken before this returns (the caller may donate the
        arrays then); the returned future writes them once Orbax has made the
        directory.
        """
        names = [info.name for info in infos]
        paths = [_path(info) for info in infos]
        _check_savable(values, paths)
        casts = [getattr(a, "dtype", None) for a in args or [None] * len(values)]
        cache: dict[Any, Any] = {}
        shardings = [_sharding_json(x.sharding, cache) for x in values]
        taken = _typed.take(
            names, paths, values, shardings, casts, primary_host=self._primary_host
        )
        process = jax.process_index()
        primary = process == self._primary_host
        if taken.local is None and not primary:
            return []

        async def write() -> None:
            await asyncio.gather(*(info.await_path_creation() for info in infos))
            _typed.write(infos[0].parent_dir, taken, process, primary)

        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                write(), name="orbax_eqx_typed"
            )
        ]

    async def deserialize(
        self,
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.RestoreArgs] | None = None,
    ) -> list[Any]:
        """Reads the leaves of `infos`, onto the shardings and dtypes `args` ask.

        `ArrayRestoreArgs` are honoured: `sharding` (or `mesh` and
        `mesh_axes`), `dtype` (a cast), `global_shape` with `strict` (False
        truncates or zero-pads). Without a sharding, the saved one is used if
        this process can rebuild it.
        """
        await asyncio.gather(*(info.await_path_creation() for info in infos))
        directory = infos[0].parent_dir
        groups = await asyncio.to_thread(_typed.find, directory)
        if not groups:  # saved by Orbax's own handler
            orbax = ocp.type_handlers.get_type_handler(jax.Array)
            return await orbax.deserialize(infos, args)
        args = args or [ocp.type_handlers.RestoreArgs() for _ in infos]
        plans = _plan(directory, groups, infos, args)
        return await asyncio.to_thread(_read, plans, self._verify)

    async def metadata(
        self, infos: Sequence[ocp.type_handlers.ParamInfo]
    ) -> list[ocp.metadata.ArrayMetadata]:
        """Shape, dtype and saved sharding of each leaf, from the group indexes."""
        await asyncio.gather(*(info.await_path_creation() for info in infos))
        directory = infos[0].parent_dir
        groups = await asyncio.to_thread(_typed.find, directory)
        if not groups:
            orbax = ocp.type_handlers.get_type_handler(jax.Array)
            return await orbax.metadata(infos)
        _check_listed(directory, groups, infos)
        result = []
        for info in infos:
            group = groups[info.name]
            record = group.saved.leaves[info.name]
            result.append(
                ocp.metadata.ArrayMetadata(
                    name=info.name,
                    directory=directory,
                    shape=record.shape,
                    sharding=_sharding_metadata(group.shardings.get(info.name)),
                    dtype=parse_dtype(record.dtype),
                )
            )
        return result


def _path(info) -> str:
    """The leaf path for messages: `['params']['w']`, else the leaf name."""
    if info.keypath is not None:
        try:
            return jtu.keystr(tuple(info.keypath))
        except (TypeError, ValueError):
            pass
    return info.name


def _check_savable(values: Sequence[Any], paths: Sequence[str]) -> None:
    problems, local = [], []
    multihost = jax.process_count() > 1
    for path, x in zip(paths, values):
        if not isinstance(x, jax.Array):
            problems.append(
                f"Leaf `{path}` is a {type(x).__module__}.{type(x).__qualname__}, "
                "not a jax.Array."
            )
        elif multihost and x.is_fully_addressable and x.size:
            ids = sorted(d.id for d in x.sharding.device_set)
            local.append(
                f"Leaf `{path}` is a host-local jax.Array (shape {x.shape}, on "
                f"device{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} "
                f"of process {jax.process_index()} only)."
            )
    if problems:
        raise UnsupportedLeafError(
            "PackedArrayHandler saves jax arrays only:\n"
            + bullet_list(problems)
            + "\nRegister it for jax.Array alone: use `oeqx.type_handler_registry()`."
        )
    if local:
        raise HostLocalArrayError(
            f"Cannot save: this save runs on {jax.process_count()} processes, and "
            "a multi-host checkpoint holds only global arrays.\n"
            + bullet_list(local)
            + "\nMake each a global array before saving, on a mesh of every "
            "process's devices: `jax.make_array_from_process_local_data("
            "NamedSharding(mesh, P()), x)` for a value that is the same on every "
            "process."
        )


def _sharding_json(sharding: Any, cache: dict) -> Any:
    """Orbax's metadata of a sharding, as JSON (None where Orbax has none)."""
    if sharding in cache:
        return cache[sharding]
    result = None
    for name, (cls, kind) in _SHARDING_METADATA.items():
        if isinstance(sharding, cls):
            meta = kind.from_jax_sharding(sharding)
            result = {
                "class": name,
                "metadata": json.loads(meta.to_serialized_string()),
            }
            result["text"] = describe(sharding)
    cache[sharding] = result
    return result


def _sharding_metadata(stored: Any) -> Any:
    """The stored sharding as Orbax's `ShardingMetadata`, or None."""
    if not isinstance(stored, dict) or stored.get("class") not in _SHARDING_METADATA:
        return None
    try:
        return _SHARDING_METADATA[stored["class"]][1].from_deserialized_dict(
            stored["metadata"]
        )
    except (KeyError, TypeError, ValueError):
        return None


def _check_listed(directory, groups, infos) -> None:
    missing = [_path(i) for i in infos if i.name not in groups]
    if missing:
        found = ", ".join(sorted({g.directory.name for g in groups.values()}))
        raise CheckpointDamagedError(
            f"No index of arrays saved with orbax_eqx's type handler in "
            f"{directory} lists these leaves (it has {found}):\n"
            + bullet_list([f"Leaf `{p}`" for p in missing])
            + "\nThe checkpoint is damaged, or they were saved by another handler "
            "into the same directory. Restore an earlier step."
        )


class _Plan:
    """How one leaf is read: a request of its group, and an optional resize."""

    def __init__(self, name, group, request, resize_to=None, sharding=None):
        self.name = name
        self.group = group
        self.request = request
        self.resize_to = resize_to  # a new global shape (`strict=False`)
        self.sharding = sharding  # where the resized array goes


def _plan(directory, groups, infos, args) -> list[_Plan]:
    """Checks every leaf's restore args against its record, then plans reads.

    Every problem is reported at once, before any array byte is read.
    """
    _check_listed(directory, groups, infos)
    problems: list[str] = []
    fixes: dict[str, None] = {}  # in order, once each
    plans = []
    for info, arg in zip(infos, args):
        group = groups[info.name]
        record = group.saved.leaves[info.name]
        path = _path(info)
        saved = parse_dtype(record.dtype)
        dtype = getattr(arg, "dtype", None)
        if dtype is None or is_key_dtype(saved) and str(dtype) == str(saved):
            dtype = saved
        elif is_key_dtype(saved) or is_key_dtype(dtype):
            asked = dtype if is_key_dtype(dtype) else np.dtype(dtype)
            problems.append(
                f"Leaf `{path}` is {record.dtype} in the checkpoint; the restore "
                f"asks for {asked}."
            )
            fixes[
                "Typed PRNG keys restore as the keys they are: ask for their "
                "saved dtype."
            ] = None
            continue
        else:
            dtype = np.dtype(dtype)
        sharding = _target_sharding(arg, group.shardings.get(info.name))
        if isinstance(sharding, str):
            problems.append(f"Leaf `{path}` has no target sharding: {sharding}.")
            fixes[
                "Give each jax array a sharding of this process's devices: "
                "`ArrayRestoreArgs(sharding=...)`, or a target leaf with one "
                "(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`)."
            ] = None
            continue
        shape = getattr(arg, "global_shape", None)
        shape = record.shape if shape is None else tuple(shape)
        if shape == record.shape:
            request = _typed.Request(record, dtype, JAX, sharding)
            plans.append(_Plan(info.name, group, request))
            continue
        if getattr(arg, "strict", True) or len(shape) != len(record.shape):
            problems.append(
                f"Leaf `{path}` has shape {record.shape} in the checkpoint; the "
                f"restore asks for {shape}."
            )
            fixes[
                "Restore into a target of the saved shape (`metadata()` lists "
                "them); to truncate or zero-pad along the same dimensions, pass "
                "`ArrayRestoreArgs(..., strict=False)` (`StandardRestore(..., "
                "strict=False)`)."
            ] = None
            continue
        if is_key_dtype(saved):
            problems.append(
                f"Leaf `{path}` holds typed PRNG keys of shape {record.shape}; "
                f"the restore asks for {shape}."
            )
            fixes["Typed PRNG keys cannot be truncated or padded."] = None
            continue
        request = _typed.Request(record, dtype, NUMPY, None)
        plans.append(_Plan(info.name, group, request, shape, sharding))
    if problems:
        raise CheckpointMismatchError(
            f"Cannot restore these leaves from the checkpoint in {directory}:\n"
            + bullet_list(problems)
            + "\n"
            + " ".join(fixes)
        )
    return plans


def _target_sharding(arg: Any, stored: Any) -> Any:
    """The sharding a leaf goes to, or a string saying why there is none."""
    mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
    if mesh is not None and axes is not None:
        return jax.sharding.NamedSharding(mesh, axes)
    sharding = getattr(arg, "sharding", None)
    if isinstance(sharding, ocp.metadata.ShardingMetadata):
        return sharding.to_jax_sharding()
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        sharding = getattr(sharding, "sharding", None)  # a `Format`: its sharding
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    meta = _sharding_metadata(stored)
    if meta is None:
        return "none was given, and none was saved"
    try:
        return meta.to_jax_sharding()
    except Exception:  # Orbax's reasons name every device: too long per leaf
        return (
            f"none was given, and the saved one ({stored.get('text')}) cannot be "
            f"rebuilt on this process's {jax.device_count()} device(s)"
        )


def _read(plans: list[_Plan], verify: bool) -> list[Any]:
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


def _resized(host: np.ndarray, shape: tuple[int, ...], sharding) -> jax.Array:
    """`host` truncated or zero-padded to `shape`, placed on `sharding`."""
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(host.shape, shape))
    out[common] = host[common]
    return jax.make_array_from_callback(shape, sharding, lambda i: out[i])
