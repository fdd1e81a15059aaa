"""Streaming: a box larger than a staging job, put in place part by part."""

import functools
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)


def slabs(start, shape, budget: int, cost: Callable[[Box], int]) -> list[Box]:
    """Cuts the box `(start, shape)` into slabs, in C order, of at most `budget`
    bytes of `cost` each (where some can be made that small)."""
    start, shape = tuple(start), tuple(shape)
    for k in range(len(shape)):
        first = (start, (1,) * k + shape[k:])  # a slab of the whole axis k
        whole = cost(first)
        m = max(1, min(shape[k], shape[k] * budget // max(1, whole)))
        while True:
            # Balanced: as few slabs as `m` allows, of lengths that overlap
            # little (the last slab moves back over the one before it).
            m = -(-shape[k] // -(-shape[k] // m))
            found = _cut(start, shape, k, m)
            if all(cost(s) <= budget for s in found):
                return found
            if m == 1:
                break
            m //= 2
    return _cut(start, shape, len(shape) - 1, 1) if shape else [(start, shape)]


def _cut(start, shape, k: int, m: int) -> list[Box]:
    out = []
    for lead in itertools.product(*(range(n) for n in shape[:k])):
        for j in range(0, shape[k], m):
            j = min(j, shape[k] - m)
            # `lead` indexes the first k axes only: zip stops there.
            at = tuple(a + i for a, i in zip(start, lead, strict=False))
            at += (start[k] + j,)
            size = (1,) * k + (m,) + shape[k + 1 :]
            out.append((at + start[k + 1 :], size))
    return out


def nbytes(shape, itemsize: int) -> int:
    return math.prod(shape) * itemsize


def zeros(shape, dtype, device) -> jax.Array:
    """A buffer on `device` to stream a box into."""
    return jnp.zeros(shape, dtype, device=device)


@functools.partial(jax.jit, donate_argnums=0)
def _update(buffer, part, *start):
    return jax.lax.dynamic_update_slice(buffer, part, start)


def update(buffer: jax.Array, part: jax.Array, start) -> jax.Array:
    """`buffer` with `part` written at `start`, in place (the buffer is donated)."""
    return _update(buffer, part, *(np.int32(s) for s in start))
