"""64-bit arrays while JAX is 32-bit: restored as they were, or refused, never
narrowed.

With `jax_enable_x64` off (JAX's default), a jax array cannot be float64,
int64, uint64 or complex128: `jax.device_put` of a float64 buffer silently
gives float32. A `jax.ShapeDtypeStruct` can still say float64, so a skeleton
can ask for what JAX cannot make. A leaf saved as a numpy array is then
restored as that numpy array; a leaf saved as a jax array (with x64 on) is
refused, with the ways to get it. Without a skeleton, such leaves come back as
numpy arrays.
"""

import functools
from typing import Any

import jax
import numpy as np

from .._tree.walk import (
    JAX,
    NUMPY,
    NUMPY_SCALAR,
    container,
    is_key_dtype,
    parse_dtype,
)

# The dtypes that JAX narrows while x64 is off, and what it narrows them to.
_NARROWER = {
    np.dtype(wide): np.dtype(narrow)
    for wide, narrow in [
        (np.float64, np.float32),
        (np.int64, np.int32),
        (np.uint64, np.uint32),
        (np.complex128, np.complex64),
    ]
}

FIX = (
    "JAX holds no 64-bit arrays while `jax_enable_x64` is off (its default): to "
    'restore such a leaf as saved, call `jax.config.update("jax_enable_x64", '
    "True)` before restoring; to get it as a numpy array, put "
    "`np.empty(shape, dtype)` at that leaf of the skeleton; to narrow it to 32 "
    "bits, give that leaf the 32-bit dtype and pass `EqxRestore(..., cast=True)`."
)
FIX_EVAL_SHAPE = (
    "`eqx.filter_eval_shape` and `jax.eval_shape` give 32-bit dtypes while "
    "`jax_enable_x64` is off: to get back a saved 64-bit numpy array as it was, "
    "put `np.empty(shape, dtype)` (or a `jax.ShapeDtypeStruct` of the 64-bit "
    "dtype) at that leaf of the skeleton."
)


def narrowed(dtype: Any) -> bool:
    """Whether JAX, as configured now, would make `dtype` narrower."""
    wide = _wide(dtype)
    # Asked each time, not cached: x64 can be switched on and off at run time.
    return wide is not None and jax.dtypes.canonicalize_dtype(wide) != wide


@functools.cache
def _wide(dtype: Any) -> np.dtype | None:
    """`dtype` as a numpy dtype if it is one JAX narrows while x64 is off (asked
    per array leaf: cached per dtype)."""
    wide = None if is_key_dtype(dtype) else np.dtype(dtype)
    return wide if wide in _NARROWER else None


def wanted_container(x: Any, record) -> str | None:
    """The container a skeleton leaf `x` restores as, given the saved `record`;
    None if JAX cannot hold what the skeleton asks for."""
    if not isinstance(x, jax.ShapeDtypeStruct) or not narrowed(x.dtype):
        return container(x)
    if record.container in (NUMPY, NUMPY_SCALAR) and str(x.dtype) == record.dtype:
        return record.container  # saved as numpy: given back as it was
    return None


def flat_container(record) -> str:
    """The container a leaf restores as without a skeleton."""
    if record.container == JAX and narrowed(parse_dtype(record.dtype)):
        return NUMPY_SCALAR if record.shape == () else NUMPY
    return record.container


def narrowed_stand_in(mine: Any, saved: str) -> bool:
    """Whether the skeleton's dtype `mine` is what JAX made, with x64 off, of the
    saved 64-bit dtype `saved` (as `eqx.filter_eval_shape` does)."""
    if saved.startswith("key<"):
        return False
    wide = parse_dtype(saved)
    return narrowed(wide) and _NARROWER[np.dtype(wide)] == mine
