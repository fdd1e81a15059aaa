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

import math
from typing import NamedTuple

import numpy as np

Box = tuple[tuple[int, int], ...]


class Piece(NamedTuple):
    """Values shared by a box of leaf `leaf` and a box of tensor `tensor`.

    (A named tuple: a stack of a million layers makes a million pieces.
    `check` says whether one keeps the contract above.)"""

    leaf: str  # leaf name (`blocks.attn.query.weight`)
    leaf_box: Box
    tensor: str  # tensor name in the other layout (`h.3.attn.c_attn.weight`)
    tensor_box: Box
    perm: tuple[int, ...]  # axes of the tensor box, in the leaf's order


def check(piece: Piece) -> None:
    """Raises `ValueError` if `piece` breaks the contract of this module."""
    if sorted(piece.perm) != list(range(len(piece.tensor_box))):
        raise ValueError(f"{piece}: perm is not a permutation of the tensor axes")
    if math.prod(shape(piece.leaf_box)) != math.prod(shape(piece.tensor_box)):
        raise ValueError(f"{piece}: the boxes hold different numbers of values")
    tensor_shape = shape(piece.tensor_box)
    if size(piece.leaf_box) and [n for n in shape(piece.leaf_box) if n != 1] != [
        tensor_shape[a] for a in piece.perm if tensor_shape[a] != 1
    ]:
        raise ValueError(f"{piece}: the boxes differ by more than axes of length 1")


def shape(box: Box) -> tuple[int, ...]:
    return tuple([stop - start for start, stop in box])


def slices(box: Box) -> tuple[slice, ...]:
    return tuple([slice(start, stop) for start, stop in box])


def to_leaf(piece: Piece, tensor_part: np.ndarray) -> np.ndarray:
    """`tensor_part` (the values of `piece.tensor_box`) as the leaf box's values."""
    return tensor_part.transpose(piece.perm).reshape(shape(piece.leaf_box))


def to_tensor(piece: Piece, leaf_part: np.ndarray) -> np.ndarray:
    """`leaf_part` (the values of `piece.leaf_box`) as the tensor box's values."""
    perm = piece.perm
    if perm == _IDENTITY[len(perm)]:  # the usual case: no permutation to undo
        return leaf_part.reshape(shape(piece.tensor_box))
    permuted = tuple(shape(piece.tensor_box)[a] for a in perm)
    return leaf_part.reshape(permuted).transpose(np.argsort(perm))


_IDENTITY = [tuple(range(n)) for n in range(65)]  # up to the 64 axes a rule allows


def size(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def _pairs(piece: Piece) -> list[tuple[int, int]]:
    """`(leaf axis, tensor axis)` of the axes that hold more than one value.

    The reshape of a piece only inserts or removes axes of length 1, so the
    other axes of the leaf box and of the permuted tensor box pair up in order;
    an axis of length 1 is clipped whole or not at all, whatever it pairs with.
    """
    leaf_shape = shape(piece.leaf_box)
    tensor_shape = shape(piece.tensor_box)
    leaf_axes = [a for a, n in enumerate(leaf_shape) if n != 1]
    tensor_axes = [t for t in piece.perm if tensor_shape[t] != 1]
    return list(zip(leaf_axes, tensor_axes, strict=False))


def clip(piece: Piece, box: Box, *, leaf_side: bool) -> Piece | None:
    """The part of `piece` inside `box` (of the leaf, or of the tensor), or
    None if they do not overlap (or the piece holds no values)."""
    mine, other = (
        (piece.leaf_box, piece.tensor_box)
        if leaf_side
        else (piece.tensor_box, piece.leaf_box)
    )
    if len(box) != len(mine):
        raise ValueError(f"a box of rank {len(box)} for {piece}")
    cut = tuple(
        (max(a, c), min(b, d)) for (a, b), (c, d) in zip(mine, box, strict=True)
    )
    if any(a >= b for a, b in cut) or size(mine) == 0:  # a 0-d box always overlaps
        return None
    if cut == mine:
        return piece
    moved = list(other)
    for leaf_axis, tensor_axis in _pairs(piece):
        m, o = (leaf_axis, tensor_axis) if leaf_side else (tensor_axis, leaf_axis)
        offset = other[o][0] - mine[m][0]
        moved[o] = (cut[m][0] + offset, cut[m][1] + offset)
    leaf_box, tensor_box = (cut, tuple(moved)) if leaf_side else (tuple(moved), cut)
    return piece._replace(leaf_box=leaf_box, tensor_box=tensor_box)
