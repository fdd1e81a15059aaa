"""`drop` and `ignore`: what one side has and the other does not.

`{"op": "drop", "match": "rope.freqs"}`: leaves left out of the tensors; a
load keeps the skeleton's values (the inverse). `{"op": "ignore", "match":
"**.attn.bias"}`: tensors a load leaves alone, by their final names; matching
nothing is no error (files differ in which buffers they keep).
"""

from ..stage import Context, Virtual
from .base import Match, Rule, each_matched, first_match


class Drop(Rule, frozen=True, tag="drop"):
    match: Match

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def drop(v: Virtual) -> list[Virtual]:
            ctx.dropped.append(v)
            return []

        return each_matched(self, virtuals, ctx, drop)


class Ignore(Rule, frozen=True, tag="ignore"):
    match: Match

    def ignores(self, name: str) -> bool:
        return first_match(self.selected(), name) is not None

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        return virtuals  # the planner asks `ignores` when it compares tensors
