"""`transpose`: the tensor holds a leaf's axes in another order.

`{"op": "transpose", "match": "h.{i}.attn.c_attn.weight", "perm": [1, 0]}`:
the tensor is `x.transpose(perm)` of what the rules before made (GPT-2's
`Conv1D` keeps its weight as (in, out), where `eqx.nn.Linear` has (out,
in)). `"perm": null` reverses the axes. `"match"` is a template or a list of
them, wildcards allowed.

Inverse: the inverse permutation, which each piece carries (`Piece.perm`).
"""

from typing import Annotated

import msgspec

from ..errors import MappingError
from ..stage import Context, Virtual, permute
from .base import MAX_RANK, Match, Rule, each_matched, patterns, selector

AxisIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK - 1)]
_WHERE = 'A `transpose` rule: "match"'


class Transpose(Rule, frozen=True, tag="transpose"):
    match: Match
    perm: Annotated[list[AxisIndex], msgspec.Meta(max_length=MAX_RANK)] | None = None

    def __post_init__(self):
        selector(patterns(self.match), _WHERE)
        if self.perm is not None and sorted(self.perm) != list(range(len(self.perm))):
            raise MappingError(
                f'A `transpose` rule: "perm" {list(self.perm)} is not a permutation '
                f"of the axes 0 to {len(self.perm) - 1}."
            )

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def permuted(v: Virtual) -> list[Virtual]:
            perm = tuple(self.perm or reversed(range(len(v.shape))))
            if len(perm) != len(v.shape):
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) has {len(v.shape)} axes (shape "
                    f"{v.shape}), but {ctx.at_rule()} permutes {len(perm)}.",
                    "Give `transpose` a permutation of every axis of the tensors it "
                    "matches (after any `stack`, without the layer axes).",
                )
                return [v]
            return [
                v.but(
                    shape=tuple(v.shape[a] for a in perm),
                    pieces=tuple(permute(p, perm) for p in v.pieces),
                )
            ]

        return each_matched(self.match, _WHERE, virtuals, ctx, permuted)
