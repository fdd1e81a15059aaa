"""A local type-handler registry that stores jax arrays in packs, for Orbax's
own `PyTreeCheckpointHandler`. (Orbax 0.12's `StandardCheckpointHandler` takes
no registry, and reaching into its internals would tie us to private Orbax
code: use the PyTree handler, which `StandardSave` users can switch to as is.)

Orbax's global registry is never changed: the registry made here answers for
`jax.Array` with `PackedArrayHandler` and asks the global one for every other
type (so scalars, numpy arrays, strings and any handler a user registered
globally work as before).
"""

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from .type_handler import TYPESTR, PackedArrayHandler


class _PackedRegistry:
    """`ocp.type_handlers.TypeHandlerRegistry` with jax arrays in packs.

    Handlers `add`ed to it come first; then `PackedArrayHandler` for
    `jax.Array` (and its typestr); for `np.ndarray`, Orbax's own handler that
    also restores packed leaves as numpy; then Orbax's global registry, read
    only.
    """

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
