"""`EqxCheckpointableHandler`: Equinox modules through Orbax's v1 API.

Registered in Orbax's global v1 registry when `orbax_eqx` is imported. It is a
thin face on `EqxHandler`: the same files, sidecar, checks and errors, so a
checkpoint written through either is read by both.
"""

import asyncio
import contextlib
from typing import Any

import equinox as eqx
import jax
from orbax.checkpoint import v1 as ocp

from .handler import TYPESTR, EqxHandler, EqxRestore, EqxSave


class EqxCheckpointableHandler:
    """Saves and loads checkpointables that hold an Equinox module, for Orbax v1.

    Registered in Orbax's global v1 registry when `orbax_eqx` is imported, so
    `ocp.save_checkpointables`, `ocp.load_checkpointables` and
    `ocp.training.Checkpointer` pick it with no set-up for every checkpointable
    that holds an `eqx.Module` outside an optax state (or, to load, a skeleton
    of one). Anything else (a dict of arrays, an optax state, a single array)
    stays with Orbax's own handlers, as does anything named `state`: Orbax
    keeps that name for its `PyTreeHandler`. The files are `EqxHandler`'s: a
    checkpoint written through either API is read by both, and by
    `python -m orbax_eqx`. Saves use `EqxHandler()`'s default options.

    What Orbax hands the handler:

    - to save: the tree, or `oeqx.EqxSave(tree)`, which sends any tree
        through orbax_eqx, modules or not;
    - to load: a skeleton (as for `oeqx.EqxRestore`), or
        `oeqx.EqxRestore(skeleton, ...)` to use its options (`strict`,
        `prefix`, `renames`, `missing`, `cast`, `shardings`, `report`, ...),
        or `None` for a flat `{leaf name: value}` dict.

    !!! example

        ```python
        from orbax.checkpoint import v1 as ocp

        ocp.save_checkpointables(path, {"model": model, "opt_state": opt_state})
        loaded = ocp.load_checkpointables(
            path,
            {
                "model": oeqx.EqxRestore(skeleton, cast=True),
                "opt_state": abstract_opt_state,
            },
        )
        ```
    """

    async def save(self, directory, checkpointable: Any):
        """Starts a save; returns, once host copies are taken, what finishes it.

        **Arguments:**

        - `directory`: Orbax's `PathAwaitingCreation` for the item directory.
        - `checkpointable`: a PyTree holding an `eqx.Module`, or `EqxSave(tree)`.

        **Returns:** an awaitable that finishes the writes in the background.
        """
        if not isinstance(checkpointable, EqxSave):
            checkpointable = EqxSave(checkpointable)
        handler = EqxHandler()
        path = directory.path
        try:
            futures = await handler.async_save(path, args=checkpointable)
        except BaseException:
            handler.close()
            raise
        return _finish_save(handler, path, futures)

    async def load(self, directory, abstract_checkpointable: Any = None):
        """Restores the checkpointable at `directory`.

        **Arguments:**

        - `directory`: the item directory.
        - `abstract_checkpointable`: a skeleton, `EqxRestore(skeleton, ...)`,
            or `None` for a flat `{leaf name: value}` dict.

        **Returns:** an awaitable of the restored tree.
        """
        args = abstract_checkpointable
        if not isinstance(args, EqxRestore):
            args = EqxRestore(args)
        # The whole restore runs here, not in the awaitable: Orbax reports an
        # error raised by the awaitable as "incompatible handler", hiding our
        # message, while one raised here reaches the caller as it is (and
        # Orbax 0.12.8 has no asynchronous load that this would hold up). In
        # a thread, since the restore runs event loops of its own.
        tree = await asyncio.to_thread(_restore, directory, args)
        return _value(tree)

    async def metadata(self, directory):
        """What the sidecar records (`oeqx.Metadata`): leaves, modules, statics."""
        with contextlib.closing(EqxHandler()) as handler:
            return handler.metadata(directory)

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for `EqxSave(...)` and for trees holding an `eqx.Module`."""
        return isinstance(checkpointable, EqxSave) or holds_module(checkpointable)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
        """True for `EqxRestore(...)` and for skeletons holding an `eqx.Module`."""
        return isinstance(abstract_checkpointable, EqxRestore) or holds_module(
            abstract_checkpointable
        )


def holds_module(tree: Any) -> bool:
    """Whether `tree` contains an `eqx.Module` outside any optax state.

    An optax state holds the model's arrays in modules of its own (`mu`, `nu`
    of a filtered model): arrays only, which Orbax's own handler keeps well.
    """
    found = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, eqx.Module) or _is_optax_state(x)
    )
    return any(isinstance(x, eqx.Module) for x in found)


def _is_optax_state(x: Any) -> bool:
    # Optax's states are NamedTuples defined in optax; no import of optax.
    return isinstance(x, tuple) and type(x).__module__.split(".")[0] == "optax"


def _restore(directory, args: EqxRestore) -> Any:
    with contextlib.closing(EqxHandler()) as handler:
        return handler.restore(directory, args=args)


async def _value(value: Any) -> Any:
    return value


async def _finish_save(handler: EqxHandler, path, futures) -> None:
    try:
        for f in futures:
            await asyncio.to_thread(f.result)
        # Orbax's v1 layer has no `finalize` step of its own: this is where
        # `EqxHandler` merges per-process array trees and checks the step.
        await asyncio.to_thread(handler.finalize, path)
    finally:
        handler.close()


# Orbax records a v1 handler as `module.qualname` (it has no `typestr` to
# override); set to the public name, as NumPy's `set_module` does, so that
# moving the class never orphans a checkpoint. `TYPESTR` lets Orbax resolve
# checkpoints that `EqxHandler` saved to this handler as well.
EqxCheckpointableHandler.__module__ = "orbax_eqx"
ocp.handlers.register_handler(EqxCheckpointableHandler, secondary_typestrs=[TYPESTR])
