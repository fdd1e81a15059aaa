"""`transpose`: the tensor holds a leaf's axes in another order.

`{"op": "transpose", "match": "h.{i}.attn.c_attn.weight", "perm": [1, 0]}`:
the tensor is `x.transpose(perm)` of what the rules before made (GPT-2's
`Conv1D` keeps its weight as (in, out), where `eqx.nn.Linear` has (out,
in)). `"perm": null` reverses the axes. `"match"` is a template or a list of
them, wildcards allowed.

Inverse: the inverse permutation, which each piece carries (`Piece.perm`).
"""

import dataclasses
from typing import Any

from ..errors import MappingError
from ..stage import Context, Virtual, permute
from . import schema
from .base import Rule, Selector, each_matched


@dataclasses.dataclass(frozen=True)
class Transpose(Rule):
    op = "transpose"
    match: tuple[str, ...]
    perm: tuple[int, ...] | None = None
    _selector: Selector = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        where = "A `transpose` rule"
        object.__setattr__(self, "_selector", Selector(self.match, f'{where}: "match"'))
        if self.perm is not None and sorted(self.perm) != list(range(len(self.perm))):
            raise MappingError(
                f'{where}: "perm" {list(self.perm)} is not a permutation of the axes '
                f"0 to {len(self.perm) - 1}."
            )

    def to_json(self) -> dict[str, Any]:
        perm = None if self.perm is None else list(self.perm)
        return {"op": self.op, "match": self._selector.json(), "perm": perm}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Transpose":
        schema.keys(data, where, {"match"}, {"perm"})
        perm = data.get("perm")
        if perm is not None:
            items = schema.sequence(perm, f'{where}: "perm"', limit=schema.MAX_RANK)
            perm = tuple(
                schema.integer(a, f'{where}: "perm"[{i}]', 0, schema.MAX_RANK - 1)
                for i, a in enumerate(items)
            )
        return cls(schema.strings(data["match"], f'{where}: "match"'), perm)

    def label(self) -> str:
        shown = self._selector.shown()
        return (
            f".transpose({shown})"
            if self.perm is None
            else (f".transpose({shown}, {self.perm})")
        )

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def permuted(v: Virtual) -> list[Virtual]:
            perm = self.perm
            if perm is None:
                perm = tuple(reversed(range(len(v.shape))))
            if len(perm) != len(v.shape):
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) has {len(v.shape)} axes (shape "
                    f"{v.shape}), but {ctx.at_rule()} permutes {len(perm)}.",
                    "Give `transpose` a permutation of every axis of the tensors it "
                    "matches (after any `stack`, without the layer axes).",
                )
                return [v]
            return [
                dataclasses.replace(
                    v,
                    shape=tuple(v.shape[a] for a in perm),
                    pieces=tuple(permute(p, perm) for p in v.pieces),
                )
            ]

        return each_matched(self._selector, virtuals, ctx, permuted)
