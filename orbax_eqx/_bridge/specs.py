"""Leaves as the files see them: a sidecar's records as planner specs, typed PRNG
keys as their key data (`jax.random.key_data`)."""

from typing import Any

import jax

from .._format.sidecar import LeafMetadata
from .._mapping.plan import LeafSpec
from .._mapping.plan import data_of as data_of
from .._tree.names import label
from .._tree.walk import Leaf, is_key_dtype, key_impl, parse_dtype


def from_record(record: LeafMetadata) -> LeafSpec:
    """The spec of an array leaf a checkpoint's sidecar records."""
    shape, dtype = data_of(parse_dtype(record.dtype), tuple(record.shape or ()))
    return LeafSpec(record.name, label(record.name, record.path), shape, dtype)


def is_key(leaf: Leaf) -> bool:
    return is_key_dtype(leaf.value.dtype)


def wrap_key(data: Any, like: Any) -> jax.Array:
    """Key data read for the skeleton leaf `like`, as keys of its type."""
    return jax.random.wrap_key_data(data, impl=key_impl(like.dtype))
