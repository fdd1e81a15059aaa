"""`transpose`: the tensor is `x.transpose(perm)` of what the rules before made
(`{"op": "transpose", "match": "h.{i}.mlp.c_fc.weight", "perm": [1, 0]}`;
`null` reverses the axes). Inverse: the inverse permutation (`Piece.perm`)."""

from typing import Annotated

import msgspec

from ..errors import MappingError
from ..stage import Context, Virtual, permute
from .base import MAX_RANK, Match, Rule, each_matched

AxisIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK - 1)]


class Transpose(Rule, frozen=True, tag="transpose"):
    match: Match
    perm: Annotated[list[AxisIndex], msgspec.Meta(max_length=MAX_RANK)] | None = None

    def __post_init__(self):
        super().__post_init__()
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

        return each_matched(self, virtuals, ctx, permuted)
