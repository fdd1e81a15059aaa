"""Walks a PyTree into named, classified leaves and the modules that hold them."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .namer import Labels, Namer
from .names import label
from .values import SCALAR_TYPES, encode, is_named_callable, qualified_name

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


class Leaf(NamedTuple):
    # A NamedTuple, not a dataclass: a walk makes one per leaf, thousands of
    # them on a deep model with its optimizer state.
    path: tuple  # the JAX key path
    name: str
    kind: str
    value: Any
    shown: str | None = None  # the key path as `jtu.keystr` prints it, if known

    @property
    def path_str(self) -> str:
        return display_path(jtu.keystr(self.path) if self.shown is None else self.shown)

    @property
    def label(self) -> str:
        """How messages name this leaf (see `names.label`)."""
        return label(self.name, self.path_str)


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
    # Key path -> name, for the tree's inner nodes too (see `_tree/nodes.py`).
    name_of: Callable[[tuple], str] | None = None


def display_path(path: str) -> str:
    return path or "<root>"


def _is_none(x: Any) -> bool:
    return x is None


def is_array_leaf(x: Any) -> bool:
    """Whether a leaf is an array (`leaf_kind(x) == ARRAY`), quickly."""
    cls: type = type(x)  # (to mypy a `type[Any]` is no `Hashable` to cache on)
    return _category(cls) is _ARRAY_TYPE


def leaf_kind(x: Any) -> str:
    cls: type = type(x)
    category = _category(cls)
    if category is _ARRAY_TYPE:
        return ARRAY
    if category is _SCALAR_TYPE:
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
    cls: type = type(x)
    return _container(cls)


@functools.cache
def _container(kind: type) -> str:
    if issubclass(kind, np.ndarray):
        return NUMPY
    if issubclass(kind, np.generic):
        return NUMPY_SCALAR
    return JAX


def dtype_str(x: Any) -> str:
    return _dtype_str(x.dtype)


# Per dtype, cached: `str` of a dtype and `jax.dtypes.issubdtype` each cost
# microseconds, asked once or twice per leaf.
@functools.cache
def _dtype_str(dtype: Any) -> str:
    return str(dtype)


@functools.cache
def is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def key_impl(dtype: Any) -> str:
    """The name of the PRNG implementation of a key dtype (`threefry2x32`...)."""
    for impl in _KEY_IMPLS:
        if str(_key_dtype(impl)) == str(dtype):
            return impl
    raise ValueError(f"unknown PRNG key type {str(dtype)!r}")


# Cached: these trace a function each, and restores ask once per leaf.
@functools.cache
def _key_dtype(impl: str) -> Any:
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


@functools.cache
def key_data_struct(dtype: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of the data of a single key of PRNG key dtype `dtype`."""
    impl = key_impl(dtype)
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))


@functools.cache
def parse_dtype(text: str) -> Any:
    """The dtype named `text`: numpy, ml_dtypes (`bfloat16`, `int4`) or a PRNG key."""
    if text.startswith("key<"):
        return _key_dtype(key_impl(text))
    return jnp.dtype(text)


def walk(tree: Any, pause: Callable[[], None] | None = None) -> Walked:
    """Flattens `tree` into leaves with names, plus every module's static fields."""
    pause = pause or _no_pause
    path_leaves, treedef = jtu.tree_flatten_with_path(tree, is_leaf=_is_none)
    modules: list[tuple[tuple, eqx.Module]] = []
    states: dict[tuple, tuple] = {}
    _collect_nodes(tree, (), modules, states)
    labels = Labels()
    name_of = Namer(states, modules, labels)
    leaves = []
    for path, value in path_leaves:
        pause()
        name, text = labels(path)
        if states:
            name = name_of(path)
        leaves.append(Leaf(path, name, leaf_kind(value), value, text))
    infos = {}
    for path, m in modules:
        pause()
        infos[name_of(path)] = ModuleInfo(
            display_path(labels(path)[1]), _class_name(type(m)), _static_fields(m)
        )
    return Walked(leaves, treedef, infos, name_of)


def _no_pause() -> None:
    pass


# What a node's type says about it. Decided once per type: `isinstance` on an
# Equinox module looks up `__class__` through `Module.__getattribute__`, which
# costs more than the rest of a walk on a model of thousands of modules.
_ARRAY_TYPE = "array"
_SCALAR_TYPE = "scalar"
_MODULE_TYPE = "module"
_STATE_TYPE = "state"
_SEQUENCE_TYPE = "sequence"
_OTHER_TYPE = "other"


@functools.cache
def _category(kind: type) -> str:
    if kind in SCALAR_TYPES:
        return _SCALAR_TYPE
    if issubclass(kind, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return _ARRAY_TYPE
    if issubclass(kind, eqx.nn.State):
        return _STATE_TYPE
    if issubclass(kind, eqx.Module):
        return _MODULE_TYPE
    if kind is list or kind is tuple:
        return _SEQUENCE_TYPE
    return _OTHER_TYPE


def _collect_nodes(node, path, modules, states) -> None:
    """Finds every module (recursively) and every `eqx.nn.State` in the tree."""
    cls: type = type(node)
    category = _category(cls)
    if category is _ARRAY_TYPE or category is _SCALAR_TYPE:
        return  # holds no module; skipped without asking JAX to flatten it
    if category is _STATE_TYPE:
        states[path] = node.tree_flatten()[1]
        return
    if category is _MODULE_TYPE:
        modules.append((path, node))
        # A module's children are its dynamic fields, in order, keyed by
        # name (as Equinox flattens it), read directly: asking JAX to
        # flatten every module costs more than the rest of a save.
        dynamic, _ = fields_of(cls)
        values = object.__getattribute__(node, "__dict__")
        for name in dynamic:
            if name in values:
                _collect_nodes(
                    values[name], path + (jtu.GetAttrKey(name),), modules, states
                )
        return
    if category is _SEQUENCE_TYPE:
        for i, sub in enumerate(node):
            _collect_nodes(sub, path + (jtu.SequenceKey(i),), modules, states)
        return

    def stop(x):
        return x is not node and (
            x is None or isinstance(x, (eqx.Module, eqx.nn.State))
        )

    for sub_path, sub in jtu.tree_flatten_with_path(node, is_leaf=stop)[0]:
        if sub_path:
            _collect_nodes(sub, path + sub_path, modules, states)


@functools.cache
def fields_of(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of a module class's dynamic and static fields."""
    dynamic: list[str] = []
    static: list[str] = []
    for f in dataclasses.fields(cls):
        (static if f.metadata.get("static", False) else dynamic).append(f.name)
    return tuple(dynamic), tuple(static)


@functools.cache
def _class_name(cls: type) -> str:
    return qualified_name(cls)


def _static_fields(module: eqx.Module) -> dict[str, Any]:
    _, static = fields_of(type(module))
    if not static:
        return {}
    # Read from the instance's dict, as `_collect_nodes` reads dynamic fields:
    # `getattr` goes through `Module.__getattribute__`, which on a model of
    # thousands of modules cost more than the rest of the walk.
    values = object.__getattribute__(module, "__dict__")
    return {
        name: encode(values[name] if name in values else getattr(module, name, None))
        for name in static
    }
