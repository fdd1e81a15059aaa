"""What the planner carries from rule to rule: the tensors made so far.

The planner runs a mapping's rules in order, from the leaves towards the
tensors. Between two rules, every name is a `Virtual`: a tensor in the
making, with its shape and dtype, and the pieces (`pieces.Piece`) of leaves
that hold its values. A rule replaces virtuals by others (renamed, split,
stacked...) and moves their pieces along; the last virtuals are the tensors.
Nothing here touches array values: a virtual is a few boxes per leaf.

`Context` collects the problems of a whole planning run, so that every
problem is reported at once.
"""

import dataclasses
from collections.abc import Iterable

import numpy as np

from .._errors import some
from .pieces import Box, Piece, clip

# A layer a virtual belongs to: (index of the stack rule, the layer's indices).
Layer = tuple[int, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Virtual:
    name: str
    shape: tuple[int, ...]
    dtype: str
    # Pieces whose `tensor_box` is in this virtual's coordinates (their
    # `tensor` field is set once the final names are known).
    pieces: tuple[Piece, ...]
    leaves: tuple[str, ...]  # names of the leaves whose values it holds
    layers: tuple[Layer, ...] = ()


class Context:
    """Problems found while planning, each a sentence, with the fixes to offer."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels  # leaf name -> how messages show it
        self.problems: list[str] = []
        self.fixes: list[str] = []
        self.rule = -1  # index of the rule being applied
        self.dropped: list[Virtual] = []  # virtuals that rules left out
        self.rule_label = ""

    def problem(self, text: str, fix: str | None = None) -> None:
        self.problems.append(text)
        if fix is not None and fix not in self.fixes:
            self.fixes.append(fix)

    def at_rule(self) -> str:
        return f"rule {self.rule} `{self.rule_label}`"

    def origin(self, v: Virtual) -> str:
        """`leaf `x`` or `leaves `x`, `y``, with the layer if there is one."""
        names = [self.labels.get(n, f"`{n}`") for n in v.leaves]
        text = ("leaf " if len(names) == 1 else "leaves ") + some(names)
        if v.layers:
            text += ", layer " + ", ".join(
                ".".join(map(str, idx)) for _, idx in v.layers
            )
        return text


def examples(names: Iterable[str], n: int = 3) -> str:
    names = list(names)
    text = ", ".join(f"`{name}`" for name in names[:n])
    return text + (", ..." if len(names) > n else "")


def permute(piece: Piece, perm: tuple[int, ...]) -> Piece:
    """The piece for the tensor `t.transpose(perm)` instead of `t`."""
    inverse = np.argsort(perm)
    return dataclasses.replace(
        piece,
        tensor_box=tuple(piece.tensor_box[a] for a in perm),
        perm=tuple(int(inverse[a]) for a in piece.perm),
    )


def shift(piece: Piece, axis: int, offset: int) -> Piece:
    """The piece for a tensor that holds this one at `offset` along `axis`."""
    box = list(piece.tensor_box)
    start, stop = box[axis]
    box[axis] = (start + offset, stop + offset)
    return dataclasses.replace(piece, tensor_box=tuple(box))


def drop_leading(piece: Piece, k: int) -> Piece:
    """The piece without the first `k` tensor axes, each of length 1."""
    return dataclasses.replace(
        piece,
        tensor_box=piece.tensor_box[k:],
        perm=tuple(a - k for a in piece.perm if a >= k),
    )


def cut(pieces: Iterable[Piece], box: Box) -> list[Piece]:
    """The pieces' parts inside `box` of the virtual."""
    out = []
    for p in pieces:
        part = clip(p, box, leaf_side=False)
        if part is not None:
            out.append(part)
    return out


def whole(shape: Iterable[int]) -> Box:
    return tuple((0, n) for n in shape)
