"""Splits an item into the arrays Orbax stores and the sidecar describing the rest."""

from typing import Any

import jax
import numpy as np

from ._errors import UnsupportedLeafError, bullet_list
from ._names import storage_key
from ._sidecar import STORED, build
from ._walk import ARRAY, Walked, walk


def prepare(item: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns (sidecar content, {storage key: array}) for `item`.

    Checks the whole item first and raises one error listing every leaf that
    cannot be saved, before anything is written.
    """
    walked = walk(item)
    _check_savable(walked)
    aliases = _aliases(walked)
    content = build(walked, aliases)
    arrays = {}
    for leaf in walked.leaves:
        record = content["leaves"][leaf.name]
        if leaf.kind == ARRAY and record["data"] == STORED:
            arrays[storage_key(leaf.name)] = _host_safe(leaf.value)
    return content, arrays


def check_has_data(item: Any) -> None:
    """Refuses skeletons early and cheaply, before Orbax starts a save."""
    leaves = jax.tree_util.tree_leaves(item)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        _check_savable(walk(item))


def _check_savable(walked: Walked) -> None:
    problems = []
    seen: dict[str, str] = {}
    for leaf in walked.leaves:
        if isinstance(leaf.value, jax.ShapeDtypeStruct):
            problems.append(
                f"Leaf `{leaf.path_str}` is a jax.ShapeDtypeStruct, which holds no "
                "data to save."
            )
        if leaf.name in seen:
            problems.append(
                f"Leaves `{seen[leaf.name]}` and `{leaf.path_str}` would both be "
                f"stored as `{leaf.name}`."
            )
        seen.setdefault(leaf.name, leaf.path_str)
    if problems:
        raise UnsupportedLeafError(
            "Cannot save this item:\n" + bullet_list(problems) + "\nSave a model "
            "with concrete arrays (skeletons from `eqx.filter_eval_shape` are for "
            "restoring), and give distinct dict keys distinct names."
        )


def _aliases(walked: Walked) -> dict[str, str]:
    """Leaves holding the very same array object as an earlier leaf (tied weights)."""
    first: dict[int, str] = {}
    aliases = {}
    for leaf in walked.leaves:
        x = leaf.value
        if leaf.kind != ARRAY or isinstance(x, np.generic) or 0 in x.shape:
            continue
        twin = first.setdefault(id(leaf.value), leaf.name)
        if twin != leaf.name:
            aliases[leaf.name] = twin
    return aliases


def _host_safe(x: Any) -> Any:
    # Orbax copies jax arrays off the device before `save` returns, but reads
    # numpy arrays later, from the background: copy them now, so that the
    # caller may change them in place as soon as `save` returns.
    if isinstance(x, (np.ndarray, np.generic)):
        return np.array(x, copy=True)
    return x
