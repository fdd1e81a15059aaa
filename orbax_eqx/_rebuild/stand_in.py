"""Stand-ins for saved arrays in a rebuilt skeleton: their shape and dtype,
no data (a restore fills them)."""

from typing import Any

import jax
import numpy as np

from .._format.sidecar import ALIAS, EMPTY, PACKED, LeafMetadata, Metadata
from .._restore.wide import flat_container
from .._tree.walk import JAX, NUMPY_SCALAR, parse_dtype

_SMALL = 64  # bytes an element of any numeric dtype fits in


def array(saved: Metadata, leaf: LeafMetadata) -> tuple[Any, str | None]:
    """`(stand-in, None)`: a skeleton leaf for a saved array, in the container
    a restore without a skeleton gives back (numpy for numpy arrays and for
    64-bit arrays while JAX is 32-bit: see `_restore/wide.py`). A numpy stand-in
    holds one element, whatever the shape: nothing is allocated for what
    only the record claims (the handler checked that packed leaves' bytes
    are in their files, see `_orbax.rebuilt._check_packs`).

    Or `(None, why not)` for an array that cannot be rebuilt."""
    dtype = parse_dtype(leaf.dtype)
    shape = tuple(leaf.shape or ())
    kind = flat_container(leaf)
    if kind == JAX:
        return jax.ShapeDtypeStruct(shape, dtype), None
    source = (
        saved.source(leaf)
        if leaf.data != ALIAS or (leaf.alias_of in saved.leaves)
        else None
    )
    if (
        leaf.data != EMPTY
        and np.dtype(dtype).itemsize > _SMALL
        and (source is None or source.data != PACKED)
    ):
        return None, (
            f"an array of dtype {leaf.dtype} stored other than packed cannot "
            "be rebuilt (a save packs such arrays)"
        )
    if leaf.data == EMPTY:
        return np.empty(shape, dtype), None  # zero elements: nothing allocated
    one = _one(np.dtype(dtype))
    if kind == NUMPY_SCALAR:
        return one, None
    return np.broadcast_to(np.asarray(one), shape), None


def _one(dtype: np.dtype) -> Any:
    """A numpy scalar of `dtype`: strings and bytes of their full size (numpy
    gives an empty string the dtype `<U0`)."""
    if dtype.kind == "U":
        return np.str_("\x01" * (dtype.itemsize // 4))
    if dtype.kind == "S":
        return np.bytes_(b"\x01" * dtype.itemsize)
    if dtype.type is np.void:
        return np.void(bytes(dtype.itemsize))
    return np.zeros((), dtype)[()]
