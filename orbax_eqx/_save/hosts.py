"""Multi-host saves: every jax array must be global, checked before any write.

In a run of several JAX processes, an array made by one process alone (`jnp.ones`,
`jax.random.key(0)`, anything on that process's own devices) is host-local:
its value may differ from process to process, and Orbax refuses it deep inside
its background write, by storage key. This says which leaf, and how to fix it,
before the manager has made a single directory.
"""

from typing import Any

import jax
import jax.tree_util as jtu

from .._errors import HostLocalArrayError, bullet_list
from .._tree.walk import walk


def check_global(tree: Any, flat: tuple[list[Any], Any] | None = None) -> None:
    """Raises `HostLocalArrayError` naming every host-local jax array in `tree`
    (`flat`: its leaves and treedef, if the caller has them)."""
    if jax.process_count() == 1:
        return
    leaves = flat[0] if flat is not None else jtu.tree_leaves(tree, is_leaf=_is_none)
    if not any(_host_local(x) for x in leaves):
        return  # paths, which cost far more than the test, only for the message
    problems = []
    for leaf in walk(tree).leaves:
        x = leaf.value
        if _host_local(x):
            devices = sorted(d.id for d in x.sharding.device_set)
            problems.append(
                f"Leaf {leaf.label} is a host-local jax.Array "
                f"(shape {x.shape}, on device{'s' if len(devices) > 1 else ''} "
                f"{', '.join(map(str, devices))} of process {jax.process_index()} "
                f"only), but this save runs on {jax.process_count()} processes."
            )
    if problems:
        raise HostLocalArrayError(
            "Cannot save: a multi-host checkpoint holds only global arrays.\n"
            + bullet_list(problems)
            + "\nMake each a global array before saving, on a mesh of every "
            "process's devices (`mesh = jax.make_mesh(...)`): "
            "`jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x)` "
            "for a value that is the same on every process (PRNG keys too), or "
            "with a sharded spec to join per-process pieces into one array; or "
            "create it inside `jax.jit(..., out_shardings=...)`. (A numpy array is "
            "saved as it is on the primary process.)"
        )


def _host_local(x: Any) -> bool:
    # Orbax's own test, so nothing it would write is refused here; arrays of
    # size zero are not given to Orbax at all.
    return isinstance(x, jax.Array) and x.is_fully_addressable and bool(x.size)


def _is_none(x: Any) -> bool:
    return x is None
