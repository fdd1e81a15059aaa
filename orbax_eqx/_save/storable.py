"""Refuses, before anything is written, arrays a checkpoint could not give back.

A save that succeeds must restore. Some arrays would not:

- a numpy array of a structured dtype (`[("a", "<i4"), ("b", "<f4")]`):
  its dtype has no name a reader could parse without evaluating text;
- a numpy array of dtype object: its elements are references to Python
  objects, not data;
- a subclass of `np.ndarray` (`np.ma.MaskedArray`, `np.matrix`, a user's
  own): a restore gives a plain array, silently dropping what the subclass
  adds (a mask). `np.memmap` adds nothing and is saved as its data;
- a jax array that was deleted (donated to a jitted function): its data is
  gone;
- with `pack=False`, an array of a dtype Orbax's array store (TensorStore)
  cannot store (`uint4`, `float8_e4m3`, text, bytes, datetimes, `longdouble`,
  big-endian): its background write would fail after the save returned.

Each is an `UnsupportedLeafError` listing every such leaf, raised where the
save starts (`EqxSave`, `prepare`), so nothing of the save is left behind.
"""

import functools
from typing import Any

import jax
import numpy as np

from .._errors import UnsupportedLeafError, bullet_list
from .._tree.walk import ARRAY, Walked, is_array_leaf, is_key_dtype

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


def check(walked: Walked, pack: bool = True, taken: bool = False) -> None:
    """Raises `UnsupportedLeafError` listing every array leaf that would save
    but not restore as it was (see the module's docstring). `taken`: the
    arrays' bytes were taken already (a save's background check), so an
    array deleted since (donated once `save` returned) is no problem."""
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
    dtype = getattr(x, "dtype", None)
    if dtype is None or is_key_dtype(dtype):
        return None
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
