"""`PackedArrayHandler`: an Orbax `TypeHandler` that stores jax arrays in packs,
and the local registry that offers it to Orbax's `PyTreeCheckpointHandler`.

Orbax hands a `TypeHandler` all the leaves of its type in one `serialize`
call, so they are written as one group of files (`_storage/typed/`) instead
of one stored array each. Orbax's global registry is never changed: the
registry made here answers for `jax.Array` with `PackedArrayHandler` and asks
the global one for every other type. (Orbax 0.12's `StandardCheckpointHandler`
takes no registry; reaching into its internals would tie us to private code.)
"""

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .._errors import (
    EARLIER_STEP,
    CheckpointDamagedError,
    HostLocalArrayError,
    OrbaxEqxError,
    UnsupportedLeafError,
    bullet_list,
    problem,
)
from .._restore.together import together
from .._save import at_exit as _at_exit
from .._save import futures as _futures
from .._storage.sharded.write import describe
from .._storage.typed import read as _typed_read
from .._storage.typed import write as _typed
from . import type_restore as _restore
from .type_restore import SHARDING_METADATA, leaf_label, leaf_path

# Pinned: checkpoints record it for every leaf this handler saved, and Orbax
# finds the handler to restore them by it.
TYPESTR = "orbax_eqx.PackedArray"


class TypeHandlerOptionError(OrbaxEqxError, ValueError):
    """Options that the pack's type handler cannot work with."""


class PackedArrayHandler(ocp.type_handlers.TypeHandler):
    """Saves the jax arrays of one Orbax save in packs, at disk speed.

    Fully replicated arrays (on one device, or a copy on every device) go end
    to end into one pack file, written by the primary host; sharded arrays go
    to shard packs: each process writes the distinct shards it holds into a
    file of its own, with an index of chunk boxes. A restore onto any
    sharding, mesh or device count reads just the byte ranges each device
    needs, checked against XXH3-64s recorded at save. No computation runs on a
    device; processes meet only at Orbax's own barrier before the commit.

    Checkpoints of Orbax's own `ArrayHandler` (saved before switching) still
    restore: this handler hands them to it.

    Use it through `oeqx.type_handler_registry()`, which leaves Orbax's global
    handler for `jax.Array` alone.

    **Arguments:**

    - `primary_host`: the process that writes the pack and the index; the same
        as `MultiprocessingOptions(primary_host=...)` of the checkpoint handler.
    - `verify`: check every byte read against its recorded checksum (a mismatch
        is a `CheckpointDamagedError` naming the leaf).

    !!! example

        ```python
        # A registry of your own: jax arrays in packs, your handler for Foo.
        registry = oeqx.type_handler_registry(primary_host=0)
        registry.add(Foo, FooHandler())
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
        ```
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
        paths = [leaf_path(info) for info in infos]
        _check_savable(values, [leaf_label(info) for info in infos])
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

        # A script that ends before Orbax commits this save gets it finished
        # at exit (`_save/at_exit.py`): a committed one has its final directory.
        where = _futures.target(infos[0].parent_dir)
        _at_exit.started(where, _futures.final_directory(infos[0].parent_dir))

        async def write() -> None:
            try:
                await asyncio.gather(*(info.await_path_creation() for info in infos))
                directory = infos[0].parent_dir
                # An error (a full disk) names the step it stopped, as ours do.
                with _futures.noted(_futures.target(directory)):
                    _typed.write(directory, taken, process, primary)
            except BaseException:
                _at_exit.ended(where)  # Orbax reports the error
                raise

        future = ocp.future.CommitFutureAwaitingContractedSignals(
            write(), name="orbax_eqx_typed"
        )
        return [_futures.NotedFuture(future, where)]

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
        directory, groups = await _groups(infos)
        if not groups:
            return await _orbax_handler(directory, infos, "deserialize", args)
        return await self._read(directory, groups, infos, args, numpy=False)

    async def deserialize_numpy(
        self,
        infos: Sequence[ocp.type_handlers.ParamInfo],
        args: Sequence[ocp.type_handlers.RestoreArgs] | None,
        orbax: ocp.type_handlers.TypeHandler,
    ) -> list[Any]:
        """Restores as numpy arrays (`restore_type=np.ndarray`): this handler's
        leaves from its groups, the others with `orbax` (Orbax's own)."""
        directory, groups = await _groups(infos)
        args = list(args or [ocp.type_handlers.RestoreArgs() for _ in infos])
        out: list[Any] = [None] * len(infos)
        for ours in (False, True):
            at = [i for i, info in enumerate(infos) if (info.name in groups) == ours]
            if not at:
                continue
            mine, wanted = [infos[i] for i in at], [args[i] for i in at]
            if ours:
                got = await self._read(directory, groups, mine, wanted, numpy=True)
            else:
                got = await orbax.deserialize(mine, wanted)
            for i, x in zip(at, got, strict=True):
                out[i] = x
        return out

    async def _read(self, directory, groups, infos, args, numpy: bool) -> list[Any]:
        args = args or [ocp.type_handlers.RestoreArgs() for _ in infos]
        # Every process ends together, all with arrays or all with the same
        # error (see `together`): one failing alone (a damaged chunk only its
        # devices need) would leave the others in Orbax's barriers.
        return await asyncio.to_thread(
            together,
            directory,
            lambda: _restore.read(
                _restore.plan(directory, groups, infos, args, numpy=numpy),
                self._verify,
            ),
        )

    async def metadata(
        self, infos: Sequence[ocp.type_handlers.ParamInfo]
    ) -> list[ocp.metadata.ArrayMetadata]:
        """Shape, dtype and saved sharding of each leaf, from the group indexes."""
        directory, groups = await _groups(infos)
        if not groups:
            return await _orbax_handler(directory, infos, "metadata")
        return _restore.array_metadata(directory, groups, infos)


async def _groups(infos) -> tuple[Any, dict]:
    """The directory of `infos`, once made, and the groups saved in it."""
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    directory = infos[0].parent_dir
    return directory, await asyncio.to_thread(_typed_read.find, directory)


def _check_none_were_ours(directory, infos, error: Exception) -> None:
    """After Orbax's own handler failed on a directory without groups: if
    Orbax's tree metadata (`_METADATA`) names this handler's type, the groups
    (and their seals) were deleted, or not copied with the checkpoint. Said
    so, not left to Orbax's error about a missing array."""
    path = epath.Path(directory) / "_METADATA"
    try:
        with path.open("rb") as f:
            text = f.read(64 << 20)
    except OSError:
        return
    if f'"{TYPESTR}"'.encode() in text:
        raise problem(
            CheckpointDamagedError,
            f"Orbax's metadata in {directory} says its arrays (such as "
            f"`{leaf_path(infos[0])}`) were saved with orbax_eqx's type handler, "
            "but it holds no orbax_eqx~typed.* directory: they were deleted, or "
            "not copied with the checkpoint.",
            file=directory,
            leaves=[i.name for i in infos],
            remedy=EARLIER_STEP,
        ) from error


async def _orbax_handler(directory, infos, method: str, *args) -> Any:
    """Orbax's global handler of jax arrays, for a checkpoint it saved."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if isinstance(handler, PackedArrayHandler):  # registered globally after all
        raise problem(
            CheckpointDamagedError,
            f"{directory} holds no orbax_eqx~typed.* directory, so none of its "
            "arrays was saved with orbax_eqx's type handler (or they were "
            "deleted), and Orbax's global handler for jax.Array is that handler "
            "too.",
            file=directory,
            remedy=EARLIER_STEP,
        )
    try:
        return await getattr(handler, method)(infos, *args)
    except Exception as e:
        _check_none_were_ours(directory, infos, e)
        raise


def _check_savable(values: Sequence[Any], labels: Sequence[str]) -> None:
    problems, local = [], []
    multihost = jax.process_count() > 1
    for path, x in zip(labels, values, strict=True):
        if not isinstance(x, jax.Array):
            problems.append(
                f"Leaf {path} is a {type(x).__module__}.{type(x).__qualname__}, "
                "not a jax.Array."
            )
        elif multihost and x.is_fully_addressable and x.size:
            # (jaxlib's `Device` is untyped to mypy)
            ids = sorted(d.id for d in x.sharding.device_set)  # type: ignore[attr-defined]
            local.append(
                f"Leaf {path} is a host-local jax.Array (shape {x.shape}, on "
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
    for name, (cls, kind) in SHARDING_METADATA.items():
        if isinstance(sharding, cls):
            meta = kind.from_jax_sharding(sharding)
            result = {
                "class": name,
                "metadata": json.loads(meta.to_serialized_string()),
            }
            result["text"] = describe(sharding)
    cache[sharding] = result
    return result


class _PackedRegistry:
    """`ocp.type_handlers.TypeHandlerRegistry` with jax arrays in packs: handlers
    `add`ed first, then `PackedArrayHandler` for `jax.Array` (and its typestr),
    `_NumpyHandler` for `np.ndarray`, then Orbax's global registry, read only."""

    def __init__(self, handler: PackedArrayHandler):
        self._handler = handler
        self._numpy = _NumpyHandler(handler)
        self._added = ocp.type_handlers.create_type_handler_registry()

    def add(
        self,
        ty: Any,
        handler: ocp.type_handlers.TypeHandler,
        func=None,
        override: bool = False,
        ignore_warnings: bool = False,
    ) -> None:
        self._added.add(ty, handler, func, override, ignore_warnings)

    def get(self, ty: Any) -> ocp.type_handlers.TypeHandler:
        if self._added.has(ty):
            return self._added.get(ty)
        if ty == TYPESTR or _is_subclass(ty, jax.Array):
            return self._handler
        if _is_subclass(ty, np.ndarray):
            return self._numpy
        return ocp.type_handlers.get_type_handler(ty)

    def has(self, ty: Any) -> bool:
        try:
            self.get(ty)
        except ValueError:
            return False
        return True

    def __repr__(self) -> str:
        return f"oeqx.type_handler_registry(primary_host={self._handler._primary_host})"


def _is_subclass(ty: Any, cls: type) -> bool:
    try:
        return isinstance(ty, type) and issubclass(ty, cls)
    except TypeError:
        return False


class _NumpyHandler(ocp.type_handlers.TypeHandler):
    """Orbax's global handler of numpy arrays (saves as it does), which also
    restores leaves of `PackedArrayHandler` asked for as numpy arrays
    (`RestoreArgs(restore_type=np.ndarray)`)."""

    def __init__(self, packed: PackedArrayHandler):
        self._packed = packed

    @staticmethod
    def _orbax() -> ocp.type_handlers.TypeHandler:
        return ocp.type_handlers.get_type_handler(np.ndarray)

    def typestr(self) -> str:
        return self._orbax().typestr()

    async def serialize(self, values, infos, args=None):
        return await self._orbax().serialize(values, infos, args)

    async def metadata(self, infos):
        return await self._orbax().metadata(infos)

    async def deserialize(self, infos, args=None):
        return await self._packed.deserialize_numpy(infos, args, self._orbax())


def type_handler_registry(
    *, primary_host: int = 0, verify: bool = True
) -> ocp.type_handlers.TypeHandlerRegistry:
    """A type-handler registry for Orbax's handlers that stores jax arrays in packs.

    Give it to `ocp.PyTreeCheckpointHandler(type_handler_registry=...)`: the
    jax arrays of each save then go, in one call, to `oeqx.PackedArrayHandler`
    (fully replicated arrays into one pack file, sharded ones into one shard
    pack per process), at disk speed instead of Orbax's cost per array; a
    restore onto any sharding reads just the bytes each device needs. Every
    other type is handled by Orbax's own handlers, and Orbax's global
    registry is not changed. Checkpoints saved before with Orbax's own
    array handler still restore through it.

    A checkpoint saved this way records the handler by name: restore it with
    a handler given this registry too (Orbax's default one cannot read it,
    and says `TypeHandler lookup failed for: type=orbax_eqx.PackedArray`).

    **Arguments:**

    - `primary_host`: the process that writes the pack and the index; pass the
        same as the handler's `MultiprocessingOptions(primary_host=...)`.
    - `verify`: check every byte read against its checksum recorded at save.

    **Returns:** an `ocp.type_handlers.TypeHandlerRegistry`.

    !!! example

        ```python
        registry = oeqx.type_handler_registry()
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
        mngr = ocp.CheckpointManager(path, item_handlers=handler)
        mngr.save(step, args=ocp.args.PyTreeSave(state))
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        state = mngr.restore(
            step, args=ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args)
        )
        ```
    """
    return _PackedRegistry(PackedArrayHandler(primary_host=primary_host, verify=verify))
