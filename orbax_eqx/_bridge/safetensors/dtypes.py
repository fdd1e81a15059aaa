"""safetensors dtype codes: the ones this reader allows, and their numpy dtypes."""

import functools
import math

import numpy as np

# Every code the format defines that numpy (with ml_dtypes) can hold, and
# nothing else: a header naming another code is refused.
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "C64": "complex64",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
CODES = {v: k for k, v in DTYPES.items()}


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype called `name`, from numpy or ml_dtypes."""
    import jax.numpy as jnp  # knows the ml_dtypes names

    return np.dtype(jnp.dtype(name))


def itemsize(name: str) -> int:
    return numpy_dtype(name).itemsize


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    # Python integers: numpy's int64 product wraps (2**62 x 4 is 0 bytes).
    return math.prod(shape) * itemsize(dtype)
