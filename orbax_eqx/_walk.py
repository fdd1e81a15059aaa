"""Walks a PyTree into named, classified leaves and the modules that hold them.

Both save and restore walk their tree (the item, or the skeleton) the same
way, so the same model always yields the same names.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._names import join, key_part
from ._values import SCALAR_TYPES, encode, is_named_callable, qualified_name

# Leaf kinds.
ARRAY = "array"  # jax / numpy array, numpy scalar, or ShapeDtypeStruct
SCALAR = "scalar"  # Python int, float, bool, complex, str, bytes, None
CALLABLE = "callable"  # function, class, partial...: recorded by name
SHARED = "shared"  # `eqx.nn.Shared`'s placeholder for a tied node
OBJECT = "object"  # anything else: recorded by type and repr

# How an array leaf is held, which decides what restore hands back.
JAX = "jax"
NUMPY = "numpy"
NUMPY_SCALAR = "numpy_scalar"


@dataclasses.dataclass(frozen=True)
class Leaf:
    path: tuple  # the JAX key path
    name: str
    kind: str
    value: Any

    @property
    def path_str(self) -> str:
        return display_path(jtu.keystr(self.path))


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    path: str  # printed key path
    cls: str  # qualified class name
    static: dict[str, Any]  # field name -> encoded value


@dataclasses.dataclass(frozen=True)
class Walked:
    leaves: list[Leaf]
    treedef: Any
    modules: dict[str, ModuleInfo]  # module name -> info


def display_path(path: str) -> str:
    return path or "<root>"


def _is_none(x: Any) -> bool:
    return x is None


def is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def leaf_kind(x: Any) -> str:
    if is_array_like(x):
        return ARRAY
    if type(x) in SCALAR_TYPES:
        return SCALAR
    if _is_shared_node(x):
        return SHARED
    if is_named_callable(x):
        return CALLABLE
    return OBJECT


def _is_shared_node(x: Any) -> bool:
    # `eqx.nn.Shared` puts this placeholder where a tied node was; its class
    # is not exported, so it is recognised by name.
    kind = type(x)
    return kind.__name__ == "SharedNode" and kind.__module__.startswith("equinox")


def container(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return NUMPY
    if isinstance(x, np.generic):
        return NUMPY_SCALAR
    return JAX


def dtype_str(x: Any) -> str:
    return str(x.dtype)


def is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def key_impl(dtype: Any) -> str:
    """The name of the PRNG implementation of a key dtype (`threefry2x32`...)."""
    for impl in _KEY_IMPLS:
        if str(_key_dtype(impl)) == str(dtype):
            return impl
    raise ValueError(f"unknown PRNG key type {str(dtype)!r}")


def _key_dtype(impl: str) -> Any:
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def parse_dtype(text: str) -> Any:
    """The dtype named `text`: numpy, ml_dtypes (`bfloat16`, `int4`) or a PRNG key."""
    if text.startswith("key<"):
        return _key_dtype(key_impl(text))
    return jnp.dtype(text)


def walk(tree: Any) -> Walked:
    """Flattens `tree` into leaves with names, plus every module's static fields."""
    path_leaves, treedef = jtu.tree_flatten_with_path(tree, is_leaf=_is_none)
    modules: list[tuple[tuple, eqx.Module]] = []
    states: dict[tuple, tuple] = {}
    _collect_nodes(tree, (), modules, states)
    name_of = _Namer(states, modules)
    leaves = [
        Leaf(path, name_of(path), leaf_kind(value), value)
        for path, value in path_leaves
    ]
    infos = {
        name_of(path): ModuleInfo(
            display_path(jtu.keystr(path)), qualified_name(type(m)), _static_fields(m)
        )
        for path, m in modules
    }
    return Walked(leaves, treedef, infos)


def _collect_nodes(node, path, modules, states) -> None:
    """Finds every module (recursively) and every `eqx.nn.State` in the tree."""
    if isinstance(node, eqx.nn.State):
        states[path] = node.tree_flatten()[1]
        return
    if isinstance(node, eqx.Module):
        modules.append((path, node))

    def stop(x):
        return x is not node and (
            x is None or isinstance(x, (eqx.Module, eqx.nn.State))
        )

    for sub_path, sub in jtu.tree_flatten_with_path(node, is_leaf=stop)[0]:
        if sub is not None and sub_path:
            _collect_nodes(sub, path + sub_path, modules, states)


def _static_fields(module: eqx.Module) -> dict[str, Any]:
    return {
        f.name: encode(getattr(module, f.name, None))
        for f in dataclasses.fields(module)
        if f.metadata.get("static", False)
    }


class _Namer:
    """Turns key paths into leaf names.

    Entries of an `eqx.nn.State` are named after the `StateIndex` that owns
    them (`state.model.bn.state_index.0`), not by their position.
    """

    def __init__(self, states: dict[tuple, tuple], modules: list):
        self._states = states
        owners = {}
        for path, m in modules:
            if isinstance(m, eqx.nn.StateIndex):
                owners.setdefault(_hashable(m.marker), path)
        self._owners = owners

    def __call__(self, path: tuple) -> str:
        parts = []
        for i, entry in enumerate(path):
            markers = self._states.get(path[:i]) if self._states else None
            if markers is not None and isinstance(entry, jtu.FlattenedIndexKey):
                parts.append(self._state_part(markers[entry.key], entry.key))
            else:
                parts.append(key_part(entry))
        return join(parts)

    def _state_part(self, marker: Any, index: int) -> str:
        owner = self._owners.get(_hashable(marker))
        if owner is not None:
            return self(owner)
        if isinstance(marker, str):
            return key_part(jtu.DictKey(marker))
        return str(index)


def _hashable(marker: Any) -> Any:
    try:
        hash(marker)
        return marker
    except TypeError:
        return id(marker)
