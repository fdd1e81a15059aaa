"""The array leaves of a tree as the planner sees them (`plan.LeafSpec`).

Named by the restore's walk (`_tree/walk.py`), so leaf names are the ones
`inspect`, `prefix=` and `renames=` use. A typed PRNG key leaf is its key
data: shape `(..., 2)` uint32 for threefry keys, as `jax.random.key_data`
gives it; loading wraps the data back into keys of the skeleton's type.
"""

from typing import Any

import numpy as np

from .._tree.walk import ARRAY, Walked, is_key_dtype, key_data_struct, key_impl
from .plan import LeafSpec


def data_of(dtype: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """The shape and dtype name an array of `dtype` is stored as in a tensor."""
    if is_key_dtype(dtype):
        data = key_data_struct(dtype)
        return tuple(shape) + tuple(data.shape), str(data.dtype)
    return tuple(shape), str(np.dtype(dtype))


def leaf_specs(walked: Walked) -> list[LeafSpec]:
    """One `LeafSpec` per array leaf of `walked`, in the tree's order."""
    specs = []
    for leaf in walked.leaves:
        if leaf.kind != ARRAY:
            continue
        x = leaf.value
        shape, dtype = data_of(x.dtype, tuple(x.shape))
        key = key_impl(x.dtype) if is_key_dtype(x.dtype) else None
        specs.append(LeafSpec(leaf.name, leaf.label, shape, dtype, key))
    return specs
