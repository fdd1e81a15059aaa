"""The checks a save makes before writing, so that what saves also restores.

Each raises naming every offending leaf, before anything is written:
`check_global`, a host-local jax array in a multi-host save (Orbax would
refuse it deep inside its background write, by storage key); `check_arrays`,
an array a checkpoint could not give back; `check_recordable`, text the
UTF-8 sidecar cannot hold or a static field nested deeper than readers read.
"""

import functools
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._errors import HostLocalArrayError, UnsupportedLeafError, bullet_list
from .._tree.names import label
from .._tree.values import MAX_DEPTH, bad_text, is_text, too_deep
from .._tree.walk import ARRAY, Walked, is_array_leaf, is_key_dtype, walk


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


_FIXES = {
    "structured": (
        "Save each field of a structured array as its own leaf "
        "(`{name: x[name] for name in x.dtype.names}`)."
    ),
    "object": (
        "Convert an object array to a numeric dtype (`x.astype(np.float32)`) "
        "or to a list of Python values (`x.tolist()`)."
    ),
    "subclass": (
        "Save what the subclass holds as leaves of its own (a masked array: "
        '`{"data": x.data, "mask": np.ma.getmaskarray(x)}`), or save a plain '
        "array (`np.asarray(x)`) if that is all you need back."
    ),
    "deleted": (
        "Save the arrays a step returns, not the ones it was given: "
        "`donate_argnums` hands an array's memory to the result."
    ),
    "store": (
        "Save with `pack=True` (the default), which stores every dtype byte "
        "for byte, or convert the array first (big-endian: "
        "`x.astype(x.dtype.newbyteorder('='))`)."
    ),
}


# What a leaf's type says, decided once per type (`isinstance` on every leaf
# of every save costs more than the rest of this check).
_NUMPY, _SUBCLASS, _JAX, _OTHER = range(4)


@functools.cache
def _category(kind: type) -> int:
    if kind is np.ndarray or kind is np.memmap or issubclass(kind, np.generic):
        return _NUMPY
    if issubclass(kind, np.ndarray):
        return _SUBCLASS
    if issubclass(kind, jax.Array):
        return _JAX
    return _OTHER


def bad_value(x: Any) -> bool:
    """Whether an array leaf would be refused whatever `pack` is; cheap, for
    every leaf of every save."""
    cls: type = type(x)  # (to mypy a `type[Any]` is no `Hashable` to cache on)
    category = _category(cls)
    if category == _NUMPY:
        return _bad_dtype(x.dtype)
    if category == _JAX:
        return x.is_deleted()
    return category == _SUBCLASS


@functools.cache
def _bad_dtype(dtype: np.dtype) -> bool:
    return dtype.fields is not None or dtype.hasobject


def check_arrays(walked: Walked, pack: bool = True, taken: bool = False) -> None:
    """Raises `UnsupportedLeafError` listing every array leaf that would save
    but not restore as it was. `taken`: the arrays' bytes were taken already
    (a save's background check): an array deleted since is no problem."""
    problems, kinds = [], []
    for leaf in walked.leaves:
        x = leaf.value
        if leaf.kind != ARRAY or not is_array_leaf(x):
            continue
        found = _problem(x, pack, taken)
        if found is not None:
            kind, what = found
            problems.append(f"Leaf `{leaf.path_str}` {what}.")
            if kind not in kinds:
                kinds.append(kind)
    if problems:
        raise UnsupportedLeafError(
            "Cannot save this item: these arrays would not restore as they are "
            "(nothing was written):\n"
            + bullet_list(problems)
            + "\n"
            + " ".join(_FIXES[kind] for kind in kinds)
        )


def _problem(x: Any, pack: bool, taken: bool = False) -> tuple[str, str] | None:
    found = _object_problem(x, taken)
    if found is not None:
        return found
    dtype = getattr(x, "dtype", None)
    if dtype is None or is_key_dtype(dtype):
        return None
    return _dtype_problem(dtype, pack)


def _object_problem(x: Any, taken: bool) -> tuple[str, str] | None:
    kind = type(x)
    if not taken and isinstance(x, jax.Array) and x.is_deleted():
        return (
            "deleted",
            f"is a jax array ({x.dtype}{list(x.shape)}) that was deleted "
            "(donated to a jitted function, or `.delete()`d): its data is gone",
        )
    if isinstance(x, np.ndarray) and kind is not np.ndarray and kind is not np.memmap:
        return (
            "subclass",
            f"is a {kind.__module__}.{kind.__qualname__}, a subclass of "
            "numpy.ndarray: a restore would give a plain numpy.ndarray and drop "
            "what the subclass adds",
        )
    return None


def _dtype_problem(dtype: Any, pack: bool) -> tuple[str, str] | None:
    if isinstance(dtype, np.dtype) and dtype.fields is not None:
        return (
            "structured",
            f"is an array of structured dtype {dtype}, which orbax_eqx cannot "
            "record so that it reads back",
        )
    if isinstance(dtype, np.dtype) and dtype.hasobject:
        return (
            "object",
            "is an array of dtype object, whose elements are Python objects, not data",
        )
    if not pack and not storable(dtype):
        return (
            "store",
            f"is an array of dtype {dtype.str if not dtype.isnative else dtype}, "
            "which Orbax's array store (TensorStore, used with `pack=False`) "
            "cannot store",
        )
    return None


@functools.cache
def storable(dtype: Any) -> bool:
    """Whether TensorStore (Orbax's array store) can store arrays of `dtype`."""
    dtype = np.dtype(dtype)
    if not dtype.isnative or dtype.fields is not None or dtype.kind in "OSUVMm":
        # `V` is numpy's void; ml_dtypes' types (bfloat16, int4...) are `V`
        # too, and are asked of TensorStore below.
        if not (dtype.kind == "V" and dtype.type is not np.void):
            return False
    import tensorstore  # Orbax's own dependency: imported by Orbax already

    try:
        tensorstore.dtype(dtype.name)
    except (TypeError, ValueError):
        return False
    return dtype.name != "bool" or dtype.itemsize == 1


_SURROGATE = (
    "holds a lone surrogate, as `os.fsdecode` makes of a file name that is not UTF-8"
)
_TEXT_FIX = (
    "The sidecar (UTF-8 JSON) cannot hold text that is not valid Unicode: store "
    "it as bytes (`os.fsencode(text)`: bytes leaves, static fields and dict keys "
    "are saved exactly), or decode it first "
    "(`os.fsencode(text).decode('utf-8', 'replace')`)."
)
_DEPTH_FIX = (
    f"A recorded value may nest {MAX_DEPTH} JSON levels deep (each tuple, list "
    "or dict takes two): make it shallower, or keep it out of the saved item."
)


def check_recordable(walked: Walked) -> None:
    """Raises `UnsupportedLeafError` listing every leaf or field that cannot be
    recorded so that it reads back."""
    text = _leaf_text(walked)
    deep: list[str] = []
    for name, module in walked.modules.items():
        if not is_text(name):
            text.append(
                f"Module `{module.path}` is under a dict key that is not valid Unicode."
            )
        _check_static(name, module, text, deep)
    if text or deep:
        fixes = ([_TEXT_FIX] if text else []) + ([_DEPTH_FIX] if deep else [])
        raise UnsupportedLeafError(
            "Cannot save this item: its sidecar would not read back.\n"
            + bullet_list(text + deep)
            + "\n"
            + " ".join(fixes)
        )


def _leaf_text(walked: Walked) -> list[str]:
    """What `check_recordable` says of leaves whose name or str is not valid
    Unicode; other leaves are recorded as descriptions, which escape such
    text."""
    text = []
    for leaf in walked.leaves:
        if not is_text(leaf.name):
            text.append(f"Leaf {leaf.label} {_key(leaf)}.")
        if type(leaf.value) is str and not is_text(leaf.value):
            text.append(
                f"Leaf {leaf.label} is a str that is not valid Unicode: "
                f"{leaf.value!r} {_SURROGATE}."
            )
    return text


def _check_static(name: str, module: Any, text: list[str], deep: list[str]) -> None:
    """Adds to `text` and `deep` what `check_recordable` says of the static
    fields of `module` (under `name`)."""
    for field, value in module.static.items():
        found, nested = bad_text(value), too_deep(value)
        if found is None and not nested:
            continue  # (the usual case: no message to word)
        where = (
            f"Static field `{field}` of module {label(name, module.path)} "
            f"({module.cls})"
        )
        if found is not None:
            text.append(
                f"{where} holds text that is not valid Unicode: {found!r} {_SURROGATE}."
            )
        if nested:
            deep.append(f"{where} nests more than {MAX_DEPTH} levels deep.")


def _key(leaf) -> str:
    for entry in leaf.path:
        key = getattr(entry, "key", None)
        if isinstance(entry, jtu.DictKey) and isinstance(key, str) and not is_text(key):
            return (
                f"is under a dict key that is not valid Unicode: {key!r} {_SURROGATE}"
            )
    return f"has a name that is not valid Unicode: {leaf.name!r} {_SURROGATE}"
