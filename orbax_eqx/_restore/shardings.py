"""Where each restored array goes: the target sharding of every array leaf.

Taken from, in order: an explicit `shardings=` (one Sharding for all, a PyTree
of shardings shaped like the skeleton, or a function of (name, leaf)); the
skeleton leaf's own sharding; one local device. An explicit sharding is always
handed to Orbax, so a checkpoint saved on 8 devices restores on 1.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._errors import CheckpointMismatchError, ShardingRuleError, bullet_list
from .._tree.walk import ARRAY, JAX, Walked, container

Shardings = jax.sharding.Sharding | Callable[[str, Any], Any] | Any


def resolve(shardings: Shardings, walked: Walked) -> dict[str, Any]:
    """Maps the name of every jax array leaf of the skeleton to its sharding."""
    wanted = [
        leaf
        for leaf in walked.leaves
        if leaf.kind == ARRAY and container(leaf.value) == JAX
    ]
    result = _resolve(shardings, walked, wanted)
    _check_fit(result, wanted)
    return result


def _resolve(shardings: Shardings, walked: Walked, wanted: list) -> dict[str, Any]:
    if shardings is None:
        return {leaf.name: _own_sharding(leaf.value) for leaf in wanted}
    if isinstance(shardings, jax.sharding.Sharding):
        return {leaf.name: shardings for leaf in wanted}
    # A module is callable too, but a module of shardings is a tree of them.
    if callable(shardings) and not isinstance(shardings, eqx.Module):
        result: dict[str, Any] = {}
        problems: list[str] = []
        fixes: list[str] = []
        for leaf in wanted:
            try:
                sharding = shardings(leaf.name, leaf.value)
            except ShardingRuleError as e:  # collect them all, then report once
                problems.extend(e.problems)
                fixes.extend(f for f in [e.fix] if f not in fixes)
                continue
            result[leaf.name] = (
                sharding if sharding is not None else _own_sharding(leaf.value)
            )
        if problems:
            raise ShardingRuleError(problems, "\n".join(fixes))
        _check_types(result, walked, "the `shardings=` function returned")
        return result
    return _from_tree(shardings, walked, wanted)


def _from_tree(shardings, walked, wanted) -> dict[str, Any]:
    def is_leaf(x):
        return x is None or isinstance(x, jax.sharding.Sharding)

    given, given_def = jtu.tree_flatten(shardings, is_leaf=is_leaf)
    if given_def != walked.treedef:
        raise CheckpointMismatchError(
            "`shardings=` is a PyTree that does not match the skeleton: it has "
            f"{len(given)} leaves where the skeleton has "
            f"{walked.treedef.num_leaves}.\n  shardings: {given_def}\n  skeleton: "
            f"{walked.treedef}\nPass one Sharding for every array, a function "
            "`(name, leaf) -> Sharding`, or a tree shaped like the skeleton with a "
            "Sharding (or None) at each leaf."
        )
    by_name = {leaf.name: s for leaf, s in zip(walked.leaves, given, strict=True)}
    result = {
        leaf.name: by_name[leaf.name]
        if by_name[leaf.name] is not None
        else _own_sharding(leaf.value)
        for leaf in wanted
    }
    _check_types(result, walked, "`shardings=` holds")
    return result


def _check_types(result: dict[str, Any], walked: Walked, source: str) -> None:
    labels = {leaf.name: leaf.label for leaf in walked.leaves}
    bad = [
        f"Leaf {labels[name]}: {source} {type(s).__name__}, not a "
        "jax.sharding.Sharding."
        for name, s in result.items()
        if not isinstance(s, jax.sharding.Sharding)
    ]
    if bad:
        raise CheckpointMismatchError(
            "Some target shardings are not shardings:\n"
            + bullet_list(bad)
            + "\nGive a jax.sharding.Sharding (for example NamedSharding(mesh, P())) "
            "for every array leaf."
        )


def _check_fit(result: dict[str, Any], wanted: list) -> None:
    """Every leaf's target sharding must be able to hold it: a mesh of devices
    (not an `AbstractMesh`), a PartitionSpec no longer than the leaf's rank,
    dimensions that divide evenly (a NamedSharding checks its axes itself).
    Checked before anything is read, all at once, naming each leaf."""
    problems: list[str] = []
    seen: dict[tuple, str | None | bool] = {}
    for leaf in wanted:
        sharding = result[leaf.name]
        shape = tuple(getattr(leaf.value, "shape", ()))
        # By identity (`result` holds each sharding): hashing one costs more.
        key = (id(sharding), shape)
        misfit = seen.get(key, False)
        if misfit is False:
            misfit = seen[key] = _misfit(sharding, shape)
        if misfit is not None:
            problems.append(f"Leaf `{leaf.path_str}` (shape {shape}): {misfit}.")
    if problems:
        raise CheckpointMismatchError(
            "Target shardings cannot hold these leaves:\n"
            + bullet_list(problems)
            + "\nGive each such leaf a sharding over a mesh of real devices "
            "(`jax.sharding.Mesh(devices, names)`, not an AbstractMesh) whose "
            "PartitionSpec has at most one entry per dimension and shards only "
            "dimensions that divide evenly (None replicates one), or use "
            "`oeqx.shardings_from_rules`."
        )


def _misfit(sharding: Any, shape: tuple[int, ...]) -> str | None:
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return (
            f"its sharding is over an AbstractMesh {dict(mesh.shape)}, which has "
            "no devices to put an array on"
        )
    spec = getattr(sharding, "spec", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and spec is not None:
        mesh = sharding.mesh
        if len(spec) > len(shape):
            return (
                f"the PartitionSpec {spec} has {len(spec)} entries, more than its "
                f"rank {len(shape)}"
            )
        for dim, entry in enumerate(spec):
            if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
                continue
            axes = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
            ways = 1
            for axis in axes:
                ways *= mesh.shape[axis]
            if shape[dim] % ways:
                return (
                    f"dimension {dim} (size {shape[dim]}) does not divide evenly "
                    f"into the {ways} parts of mesh axes {axes} ({spec})"
                )
        return None
    try:
        sharding.shard_shape(shape)
    except Exception as e:  # whatever JAX says of a sharding of its own kind
        return f"{type(sharding).__name__} cannot hold it ({str(e).splitlines()[0]})"
    return None


def _own_sharding(x: Any) -> jax.sharding.Sharding:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    return _first_device()


@functools.cache
def _first_device() -> jax.sharding.Sharding:
    # One object for every leaf: asking JAX for its devices costs microseconds
    # per leaf, and restore batches its transfers by sharding.
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
