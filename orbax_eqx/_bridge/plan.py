"""The planner: a mapping and both sides' shapes, turned into pieces.

`plan_load` (tensors into leaves) and `plan_export` (leaves into tensors)
check everything at once and return a `Plan`, which answers, for any box of
a leaf or of a tensor, the pieces that hold its values (`pieces.Piece`).
Readers and writers (in memory, safetensors files, a device's shard) follow
the pieces and nothing else.

This first version plans the identity mapping only (every array leaf is the
tensor of the same name, shape and dtype); the mapping's transformations
extend it.
"""

import dataclasses
from collections.abc import Sequence

from .._errors import OrbaxEqxError
from .pieces import Box, Piece


class BridgeError(OrbaxEqxError, ValueError):
    """A mapping does not fit the tree or the tensors it is applied to."""


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """An array leaf as the planner sees it."""

    name: str  # leaf name, `blocks.attn.query.weight`
    label: str  # how messages show it (the leaf name, and its path where it helps)
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor of the other layout as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name (`bfloat16` for safetensors' BF16)


def whole(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which boxes of which tensors hold each leaf's values, and back."""

    leaves: dict[str, LeafSpec]  # the array leaves the plan fills or reads
    tensors: dict[str, TensorSpec]  # the tensors it reads or writes
    _by_leaf: dict[str, list[Piece]]  # whole-leaf pieces, covering each leaf once
    _by_tensor: dict[str, list[Piece]]  # the same pieces, by tensor

    def leaf_pieces(self, leaf: str, box: Box | None = None) -> list[Piece]:
        """Pieces covering `box` of `leaf` (default: all of it) exactly once."""
        return _clip(self._by_leaf[leaf], box, leaf_side=True)

    def tensor_pieces(self, tensor: str, box: Box | None = None) -> list[Piece]:
        """Pieces covering `box` of `tensor` (default: all of it) exactly once."""
        return _clip(self._by_tensor[tensor], box, leaf_side=False)


def _clip(pieces: list[Piece], box: Box | None, leaf_side: bool) -> list[Piece]:
    if box is None:
        return list(pieces)
    out = []
    for p in pieces:
        mine, other = (
            (p.leaf_box, p.tensor_box) if leaf_side else (p.tensor_box, p.leaf_box)
        )
        cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(mine, box))
        if any(a >= b for a, b in cut):  # no overlap (a 0-d box always overlaps)
            continue
        # Identity pieces only: the same axes, offsets carried across.
        moved = tuple(
            (o0 + a - m0, o0 + b - m0)
            for (a, b), (m0, _), (o0, _) in zip(cut, mine, other)
        )
        leaf_box, tensor_box = (cut, moved) if leaf_side else (moved, cut)
        out.append(dataclasses.replace(p, leaf_box=leaf_box, tensor_box=tensor_box))
    return out


def plan_load(
    mapping, leaves: Sequence[LeafSpec], tensors: Sequence[TensorSpec], *, cast: bool
) -> Plan:
    """Plans filling `leaves` from `tensors`; raises `BridgeError` listing every
    problem at once."""
    if mapping is not None:
        raise NotImplementedError("mappings other than the identity")
    by_name = {t.name: t for t in tensors}
    problems = []
    pieces = {}
    for leaf in leaves:
        t = by_name.get(leaf.name)
        if t is None:
            problems.append(f"leaf {leaf.label} has no tensor")
        elif t.shape != leaf.shape:
            problems.append(
                f"leaf {leaf.label} has shape {leaf.shape} but tensor `{t.name}` "
                f"has {t.shape}"
            )
        elif t.dtype != leaf.dtype and not cast:
            problems.append(
                f"leaf {leaf.label} is {leaf.dtype} but `{t.name}` is {t.dtype}"
            )
        else:
            box = whole(leaf.shape)
            pieces[leaf.name] = [
                Piece(leaf.name, box, t.name, box, tuple(range(len(box))))
            ]
    if problems:
        raise BridgeError("; ".join(problems))
    used = {p.tensor: p for ps in pieces.values() for p in ps}
    return Plan(
        {leaf.name: leaf for leaf in leaves},
        {name: by_name[name] for name in used},
        pieces,
        {name: [p] for name, p in used.items()},
    )


def plan_export(mapping, leaves: Sequence[LeafSpec]) -> Plan:
    """Plans writing `leaves` as tensors; raises `BridgeError` listing every
    problem at once."""
    if mapping is not None:
        raise NotImplementedError("mappings other than the identity")
    tensors = [TensorSpec(leaf.name, leaf.shape, leaf.dtype) for leaf in leaves]
    return plan_load(None, leaves, tensors, cast=False)
