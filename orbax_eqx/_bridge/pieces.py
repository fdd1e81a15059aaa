"""A piece: how a box of one leaf and a box of one tensor hold the same values.

This is the one contract between the mapping's planner and everything that
moves bytes (in memory, from safetensors files, into them). The planner turns
a mapping into pieces; readers and writers only follow pieces, so every
transformation (stack, permute, split/fuse, rename) works in both directions
and for any box, whole or a device's shard.

A box is a tuple of `(start, stop)` pairs, one per axis, with step 1.

For a piece `p`, the values are related by

    leaf[p.leaf_box] ==
        tensor[p.tensor_box].transpose(p.perm).reshape(shape(p.leaf_box))

`perm` permutes the tensor box's axes into the leaf's order of the axes they
share; the reshape only inserts or removes axes of length 1 (a stacked
layer's index, which the tensor does not have). Dtype conversions are not
part of a piece: the planner records each side's dtype, and the reader or
writer casts once, after placing.
"""

import dataclasses
import math

import numpy as np

Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Values shared by a box of leaf `leaf` and a box of tensor `tensor`."""

    leaf: str  # leaf name (`blocks.attn.query.weight`)
    leaf_box: Box
    tensor: str  # tensor name in the other layout (`h.3.attn.c_attn.weight`)
    tensor_box: Box
    perm: tuple[int, ...]  # axes of the tensor box, in the leaf's order

    def __post_init__(self):
        if sorted(self.perm) != list(range(len(self.tensor_box))):
            raise ValueError(f"{self}: perm is not a permutation of the tensor axes")
        if math.prod(shape(self.leaf_box)) != math.prod(shape(self.tensor_box)):
            raise ValueError(f"{self}: the boxes hold different numbers of values")


def shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def to_leaf(piece: Piece, tensor_part: np.ndarray) -> np.ndarray:
    """`tensor_part` (the values of `piece.tensor_box`) as the leaf box's values."""
    return tensor_part.transpose(piece.perm).reshape(shape(piece.leaf_box))


def to_tensor(piece: Piece, leaf_part: np.ndarray) -> np.ndarray:
    """`leaf_part` (the values of `piece.leaf_box`) as the tensor box's values."""
    permuted = tuple(shape(piece.tensor_box)[a] for a in piece.perm)
    return leaf_part.reshape(permuted).transpose(np.argsort(piece.perm))
