"""A piece: a box of one leaf and a box of one tensor that hold the same values,
the one contract between the planner and everything that moves bytes.

A box is a tuple of `(start, stop)` pairs, one per axis. For a piece `p`:

    leaf[p.leaf_box] ==
        tensor[p.tensor_box].transpose(p.perm).reshape(shape(p.leaf_box))

where the reshape only inserts or removes axes of length 1. Dtypes are not
part of a piece: readers and writers cast once, after placing."""

import math
from typing import NamedTuple

import numpy as np

Box = tuple[tuple[int, int], ...]


class Piece(NamedTuple):
    """Values shared by a box of leaf `leaf` and a box of tensor `tensor` (a
    named tuple: a stack of a million layers makes a million)."""

    leaf: str  # leaf name (`blocks.attn.query.weight`)
    leaf_box: Box
    tensor: str  # tensor name in the other layout (`h.3.attn.c_attn.weight`)
    tensor_box: Box
    perm: tuple[int, ...]  # axes of the tensor box, in the leaf's order


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
    if perm == IDENTITY[len(perm)]:  # the usual case: no permutation to undo
        return leaf_part.reshape(shape(piece.tensor_box))
    permuted = tuple(shape(piece.tensor_box)[a] for a in perm)
    return leaf_part.reshape(permuted).transpose(np.argsort(perm))


IDENTITY = [tuple(range(n)) for n in range(65)]  # up to the 64 axes a rule allows


def size(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def _pairs(piece: Piece) -> list[tuple[int, int]]:
    """`(leaf axis, tensor axis)` of the axes longer than 1, which pair up in
    order (an axis of length 1 is clipped whole or not at all)."""
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
