"""`reshape`, `squeeze` and `expand_dims`: the tensor holds the same values in
another shape (C order), each the others' inverse, carried by the pieces.

Axes of length 1 keep each piece whole; merging or splitting axes cuts the
pieces into boxes that are boxes on both sides (a (H, hd, D) leaf as an
(H * hd, D) tensor: one piece per head), so any box of a leaf still maps to
exactly the rows that hold it. More than `MAX_PIECES` pieces is refused."""

import itertools
import math
from typing import Annotated

import msgspec

from ..errors import MappingError
from ..pieces import Box, Piece, clip, shape
from ..stage import Context, Virtual
from .base import MAX_RANK, MAX_SIZE, Axis, Match, Rule, each_matched

MAX_PIECES = 1 << 16  # pieces one reshape may cut one tensor into
Dim = Annotated[int, msgspec.Meta(ge=-1, le=MAX_SIZE)]
Axes = Annotated[list[Axis], msgspec.Meta(max_length=MAX_RANK)]
_FIX = (
    "Reshape into a shape of the same number of values; to keep planning cheap, "
    "keep the trailing axes whole (merge or split leading axes)."
)


class Reshape(Rule, frozen=True, tag="reshape"):
    match: Match
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_RANK)]

    def __post_init__(self):
        super().__post_init__()
        if self.shape.count(-1) > 1:
            raise MappingError(
                f'A `reshape` rule: "shape" {self.shape} has more than one -1.'
            )

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def new_shape(v: Virtual) -> tuple[int, ...] | None:
            known = math.prod(n for n in self.shape if n != -1)
            size = math.prod(v.shape)
            out = list(self.shape)
            if -1 in out:
                if known == 0 or size % known:
                    return None
                out[out.index(-1)] = size // known
            return tuple(out) if math.prod(out) == size else None

        return _each(self, virtuals, ctx, new_shape)


class Squeeze(Rule, frozen=True, tag="squeeze"):
    match: Match
    axes: Axes | None = None

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def new_shape(v: Virtual) -> tuple[int, ...] | None:
            rank = len(v.shape)
            if self.axes is None:
                return tuple(n for n in v.shape if n != 1)
            if any(not -rank <= a < rank for a in self.axes):
                return None
            gone = {a % rank for a in self.axes}
            if any(v.shape[a] != 1 for a in gone):
                return None
            return tuple(n for a, n in enumerate(v.shape) if a not in gone)

        return _each(self, virtuals, ctx, new_shape)


class ExpandDims(Rule, frozen=True, tag="expand_dims"):
    match: Match
    axes: Axes

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def new_shape(v: Virtual) -> tuple[int, ...] | None:
            rank = len(v.shape) + len(self.axes)
            if any(not -rank <= a < rank for a in self.axes):
                return None
            new = {a % rank for a in self.axes}
            if len(new) != len(self.axes):
                return None
            dims = iter(v.shape)
            return tuple(1 if a in new else next(dims) for a in range(rank))

        return _each(self, virtuals, ctx, new_shape)


def _each(rule, virtuals, ctx: Context, new_shape) -> list[Virtual]:
    def change(v: Virtual) -> list[Virtual]:
        target = new_shape(v)
        if target is None:
            ctx.problem(
                f"`{v.name}` ({ctx.origin(v)}) has shape {v.shape}, which "
                f"{ctx.at_rule()} cannot reshape.",
                _FIX,
            )
            return [v]
        pieces = reshaped(v.pieces, v.shape, target)
        if pieces is None:
            ctx.problem(
                f"{ctx.at_rule()} would cut `{v.name}` ({ctx.origin(v)}) into more "
                f"than {MAX_PIECES} pieces to reshape {v.shape} into {target}.",
                _FIX,
            )
            return [v]
        return [v.but(shape=target, pieces=tuple(pieces))]

    return each_matched(rule, virtuals, ctx, change)


def reshaped(pieces, old: tuple, new: tuple) -> list[Piece] | None:
    """`pieces` (boxes of a tensor of shape `old`) for the tensor reshaped to
    `new`; None if that takes more than `MAX_PIECES` pieces."""
    if math.prod(old) == 0:
        return []
    groups = _groups(old, new)
    cells = math.prod(math.prod(old[a] for a in g[0]) // g[2] for g in groups)
    if cells * max(1, len(pieces)) > MAX_PIECES:
        return None
    out = []
    for p in pieces:
        for cell_old, cell_new, pairs in _cells(old, new, groups):
            q = clip(p, cell_old, leaf_side=False)
            if q is not None:
                out.append(_moved(q, cell_old, cell_new, pairs, len(new)))
    return out


def _groups(old: tuple, new: tuple) -> list[tuple[list[int], list[int], int]]:
    """The axes of length other than 1, in groups of equal products: `(old
    axes, new axes, run)`, where `run` is the largest number of values both
    sides hold as one box (a trailing part of the group)."""
    a = [i for i, n in enumerate(old) if n != 1]
    b = [j for j, n in enumerate(new) if n != 1]
    groups = []
    while a:
        ga, gb = [a.pop(0)], [b.pop(0)]
        pa, pb = old[ga[0]], new[gb[0]]
        while pa != pb:
            if pa < pb:
                ga.append(a.pop(0))
                pa *= old[ga[-1]]
            else:
                gb.append(b.pop(0))
                pb *= new[gb[-1]]
        sa, sb = [old[i] for i in ga], [new[j] for j in gb]
        run = 1
        while sa and sb and sa[-1] == sb[-1]:
            run *= sa.pop()
            sb.pop()
        if sa:
            run *= math.gcd(sa[-1], sb[-1])
        groups.append((ga, gb, run))
    return groups


def _unravel(offset: int, axes: list[int], dims: tuple) -> dict[int, int]:
    out = {}
    for axis in reversed(axes):
        offset, out[axis] = divmod(offset, dims[axis])
    return out


def _cells(old: tuple, new: tuple, groups):
    """Every cell: its box on each side, and which old axis each new axis
    that may be longer than 1 pairs with."""
    per_group = []
    for ga, gb, run in groups:
        count = math.prod(old[i] for i in ga) // run
        options = []
        for t in range(count):
            start_a = _unravel(t * run, ga, old)
            start_b = _unravel(t * run, gb, new)
            box_a = _cell(start_a, ga, old, run)
            box_b = _cell(start_b, gb, new, run)
            wide_a = [i for i in ga if box_a[i][1] - box_a[i][0] > 1]
            wide_b = [j for j in gb if box_b[j][1] - box_b[j][0] > 1]
            options.append((box_a, box_b, dict(zip(wide_b, wide_a, strict=True))))
        per_group.append(options)
    for combo in itertools.product(*per_group):
        box_old = [(0, 1)] * len(old)
        box_new = [(0, 1)] * len(new)
        pairs: dict[int, int] = {}
        for box_a, box_b, pair in combo:
            for i, r in box_a.items():
                box_old[i] = r
            for j, r in box_b.items():
                box_new[j] = r
            pairs.update(pair)
        yield tuple(box_old), tuple(box_new), pairs


def _cell(start: dict[int, int], axes: list[int], dims: tuple, run: int):
    """The box of `run` values from `start` within a group's axes: a trailing
    run of whole axes and part of the one before."""
    box = {}
    left = run
    for axis in reversed(axes):
        if left >= dims[axis]:
            box[axis] = (0, dims[axis])
            left //= dims[axis]
        else:
            box[axis] = (start[axis], start[axis] + left)
            left = 1
    return box


def _moved(q: Piece, cell_old: Box, cell_new: Box, pairs, rank: int) -> Piece:
    """Piece `q`, inside `cell_old`, for the same values inside `cell_new`."""
    box = []
    for j in range(rank):
        i = pairs.get(j)
        if i is None:
            box.append(cell_new[j])
        else:
            offset = cell_new[j][0] - cell_old[i][0]
            box.append((q.tensor_box[i][0] + offset, q.tensor_box[i][1] + offset))
    widths = shape(q.tensor_box)
    to_new = {i: j for j, i in pairs.items()}
    long = [to_new[i] for i in q.perm if widths[i] != 1]
    perm = [j for j in range(rank) if j not in long] + long
    return q._replace(tensor_box=tuple(box), perm=tuple(perm))
