"""Checksums of array data, so that a flipped bit is found, never restored.

Two kinds, by where the bytes are when they can be summed without a copy:

- `crc32` (zlib's CRC-32) for packed arrays: computed from the host copies in
  the pack writer's thread, and from the read buffers on restore. A CRC
  catches every single-bit error, and every burst of up to 32 bits.
- `sum32` for arrays Orbax stores (sharded, maybe across hosts, so that no
  process holds all the bytes): `sum((2 * i + 1) * word_i) mod 2**32` over the
  array's 32-bit words `word_i` in C order (each element as the unsigned
  integer of its bits, zero-extended to 32 bits; 64-bit and complex elements
  as two words, low first). It is computed where the array is, by a small
  jitted reduction per array, dispatched when `save` is called and read back
  in the background; the same sum over the restored
  array checks it. A single-bit flip changes it by an odd multiple of a power
  of two below 2**32, so every one is caught; it does not depend on the
  sharding, so a restore onto another mesh checks it too. `host_sum32` is
  the same sum in numpy, for `verify`.
"""

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._errors import CheckpointDamagedError, bullet_list
from .._tree.walk import is_key_dtype

_CHUNK = 1 << 22  # elements summed at a time by numpy


def crc32(data: np.ndarray | memoryview, start: int = 0) -> int:
    """CRC-32 of an array's bytes in C order (continuing from `start`)."""
    if isinstance(data, np.ndarray):
        data = memoryview(data.reshape(-1).view(np.uint8))
    return zlib.crc32(data, start)


def device_sum32(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Starts `sum32` of each array, where it lives; returns uint32 scalars.

    Every process of a multi-host run must call this with the same arrays (it
    is one computation over global arrays). Nothing waits for the result.
    """
    # One small computation per array, not one over all of them: jit compiles
    # once per shape, dtype and sharding, a few dozen on a large model, where
    # one computation over 6,313 arrays took 37 s to compile here.
    return [_sum32(x) for x in arrays]


@jax.jit
def _sum32(x: jax.Array) -> jax.Array:
    words = _words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weights = index * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words; 64-bit and complex elements as two."""
    if is_key_dtype(x.dtype):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    name = jnp.dtype(x.dtype).name
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif name in _SUB_BYTE_FLOATS:
        x = jax.lax.bitcast_convert_type(x, jnp.uint4).astype(jnp.uint8)
    elif name in _SUB_BYTE_INTS:
        x = x.astype(jnp.int8 if name.startswith("int") else jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


# Held one per byte by numpy: integers by value, floats by their 4-bit pattern.
_SUB_BYTE_INTS = ("int4", "uint4", "int2", "uint2")
_SUB_BYTE_FLOATS = ("float4_e2m1fn",)


def host_sum32(x: np.ndarray) -> int:
    """`sum32` of a host array (typed PRNG keys: of their key data), in numpy."""
    flat = np.ascontiguousarray(x).reshape(-1)
    total, first = 0, 0  # `first`: index of the chunk's first word
    for start in range(0, flat.size, _CHUNK):
        words = _host_words(flat[start : start + _CHUNK]).reshape(-1)
        index = np.arange(first, first + words.size, dtype=np.uint64)
        weights = (index * 2 + 1).astype(np.uint32)  # mod 2**32
        total += int(np.sum(words * weights, dtype=np.uint32))
        first += words.size
    return total % 2**32


def _host_words(x: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.complexfloating):
        x = np.stack([x.real, x.imag], axis=-1)
    name = x.dtype.name
    if name in _SUB_BYTE_FLOATS:
        x = x.view(ml_dtypes.uint4).astype(np.uint8)
    elif name in _SUB_BYTE_INTS:
        x = x.astype(np.int8 if name.startswith("int") else np.uint8)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}
    # 8-byte elements as two words, low first (numpy views bytes as they are).
    return x.view(unsigned[x.dtype.itemsize]).astype(np.uint32, copy=False)


def mismatch(record: Any, kind: str, recorded: int, found: int) -> str:
    """One line of a checksum error, leaf path first."""
    return (
        f"Leaf `{record.path}` ({record.name}): {kind} recorded at save "
        f"{recorded:#010x}, computed from the data now {found:#010x}."
    )


def damaged(directory: Any, problems: Sequence[str]) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The data of {len(problems)} leaf(s) of the checkpoint in {directory} "
        "changed after it was saved (a flipped bit on disk, or a damaged copy):\n"
        + bullet_list(problems)
        + "\nRestore an earlier step (`oeqx.restore_latest` falls back past "
        "damaged steps); `python -m orbax_eqx verify PATH` checks every leaf."
    )
