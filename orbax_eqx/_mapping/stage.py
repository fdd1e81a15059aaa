"""What the planner carries from rule to rule: each name a `Virtual` (a tensor
in the making: shape, dtype, the leaves' pieces that hold it), and the
`Context` collecting every `Problem` of a planning run."""

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Literal

import msgspec
import numpy as np

from .._errors import some
from .pieces import Box, Piece, clip

Kind = Literal["absent", "unexpected", "differs", "rule"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One way the skeleton and what is stored differ: `text` names the leaf
    or tensor first; `static` (a class, static field or callable) lets
    `on_static_mismatch="warn"` pass it; `kind`: a skeleton leaf `"absent"`
    from what is stored, a stored one `"unexpected"`, both hold something
    that `"differs"`, or a mapping's `"rule"` is at fault."""

    text: str
    fixes: tuple[str, ...] = ()
    static: bool = False
    kind: Kind = "differs"


# A layer a virtual belongs to: (index of the stack rule, the layer's indices).
Layer = tuple[int, tuple[int, ...]]


class Virtual:
    """A tensor in the making (slots: a stack of a million layers makes a
    million)."""

    __slots__ = ("name", "shape", "dtype", "held", "leaves", "layers", "key")

    def __init__(self, name, shape, dtype, pieces, leaves, layers=(), key=None):
        self.name: str = name
        self.shape: tuple[int, ...] = shape
        self.dtype: str = dtype
        # Pieces whose `tensor_box` is in this virtual's coordinates (their
        # `tensor` field is set once the final names are known): one piece as
        # itself, several as a tuple (`pieces`).
        self.held: Piece | tuple[Piece, ...] = pieces[0] if len(pieces) == 1 else pieces
        self.leaves: tuple[str, ...] = leaves  # names of the leaves it holds
        self.layers: tuple[Layer, ...] = layers
        # The name's sort key (`natural`), where the rule that made the
        # name knew it cheaply (a stack's layers); None: computed when needed.
        self.key: tuple | None = key

    @property
    def pieces(self) -> tuple[Piece, ...]:
        held = self.held
        return (held,) if isinstance(held, Piece) else held

    @pieces.setter
    def pieces(self, pieces: tuple[Piece, ...]) -> None:
        self.held = pieces[0] if len(pieces) == 1 else pieces

    def but(self, **changes) -> "Virtual":
        """This virtual with some fields changed."""
        key = None if "name" in changes else self.key
        new = Virtual(
            self.name,
            self.shape,
            self.dtype,
            self.pieces,
            self.leaves,
            self.layers,
            key,
        )
        for field, value in changes.items():
            setattr(new, field, value)
        return new


class Context:
    """Problems found while planning, each a sentence, with the fixes to offer."""

    def __init__(self, labels: dict[str, str], restore: bool = False):
        self.labels = labels  # leaf name -> how messages show it
        self.restore = restore  # what is stored is a checkpoint (else tensors)
        self.problems: list[Problem] = []
        self.rule = -1  # index of the rule being applied
        self.rule_label = ""
        self.dropped: list[Virtual] = []  # virtuals that rules left out
        # Names whose problem is reported already (a split that failed): not
        # reported again as missing or unexpected.
        self.explained: set[str] = set()
        self.equal_parts: set[str] = set()  # names made by a split without sizes
        self.mapped = True  # whether a mapping's rules made the names (else by name)
        self.keys: dict[str, str] = {}  # leaf name -> PRNG impl, of typed key leaves

    def problem(self, text: str, fix: str | None = None, kind: Kind = "rule") -> None:
        self.problems.append(Problem(text, () if fix is None else (fix,), kind=kind))

    def at(self, i: int, rule) -> None:
        self.rule, self.rule_label = i, label(rule)

    def at_rule(self) -> str:
        return f"rule {self.rule} `{self.rule_label}`"

    def key_of(self, v: Virtual) -> str | None:
        """The PRNG implementation of the typed key leaf `v` holds, if any."""
        for name in v.leaves:
            if name in self.keys:
                return self.keys[name]
        return None

    def of(self, v: Virtual) -> str:
        """` (leaf `x`)` after a tensor's name, or nothing where the tensor is
        named as its one leaf."""
        if len(v.leaves) == 1 and not v.layers:
            if self.labels.get(v.leaves[0], f"`{v.leaves[0]}`") == f"`{v.name}`":
                return ""
        return f" ({self.origin(v)})"

    def origin(self, v: Virtual) -> str:
        """`leaf `x`` or `leaves `x`, `y``, with the layer if there is one."""
        names = [self.labels.get(n, f"`{n}`") for n in v.leaves]
        text = ("leaf " if len(names) == 1 else "leaves ") + some(names)
        if v.layers:
            text += ", layer " + ", ".join(
                ".".join(map(str, idx)) for _, idx in v.layers
            )
        return text


def label(rule) -> str:
    """A rule as messages show it: its JSON, cut short."""
    text = json.dumps(msgspec.to_builtins(rule), ensure_ascii=False)
    return text if len(text) <= 160 else text[:157] + "..."


def examples(names: Iterable[str], n: int = 3) -> str:
    names = list(names)
    text = ", ".join(f"`{name}`" for name in names[:n])
    return text + (", ..." if len(names) > n else "")


def permute(piece: Piece, perm: tuple[int, ...]) -> Piece:
    """The piece for the tensor `t.transpose(perm)` instead of `t`."""
    inverse = np.argsort(perm)
    return piece._replace(
        tensor_box=tuple(piece.tensor_box[a] for a in perm),
        perm=tuple(int(inverse[a]) for a in piece.perm),
    )


def shift(piece: Piece, axis: int, offset: int) -> Piece:
    """The piece for a tensor that holds this one at `offset` along `axis`."""
    box = list(piece.tensor_box)
    start, stop = box[axis]
    box[axis] = (start + offset, stop + offset)
    return piece._replace(tensor_box=tuple(box))


def drop_leading(piece: Piece, k: int) -> Piece:
    """The piece without the first `k` tensor axes, each of length 1."""
    return piece._replace(
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


_DIGITS = re.compile(r"(\d+)")


def natural(name: str) -> tuple:
    """Sort key: digit runs as numbers (`h.2` before `h.10`). The split
    alternates text and digits, so two keys compare text with text and
    numbers with numbers, place by place."""
    parts: list = _DIGITS.split(name)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts)  # (a tuple of numbers and text: the collector skips it)


def whole(shape: Iterable[int]) -> Box:
    return tuple((0, n) for n in shape)
