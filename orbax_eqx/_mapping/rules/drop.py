"""`drop` and `ignore`: what one side has and the other does not.

`{"op": "drop", "match": "rope.freqs"}`: leaves left out of the tensors (a
table a model rebuilds itself). On a load they are not read: the skeleton
must hold their values (a concrete array, not a `jax.ShapeDtypeStruct`).
Inverse: the skeleton's value kept.

`{"op": "ignore", "match": ["h.{i}.attn.bias", "**.rotary_emb.inv_freq"]}`:
tensors a load leaves alone (buffers PyTorch saves beside the weights, like
GPT-2's causal masks). It matches the final tensor names, wherever it is in
the mapping, and matching nothing is no error (files differ in which buffers
they keep). Exports ignore it; it is its own inverse.
"""

from ..stage import Context, Virtual
from .base import Match, Rule, each_matched, first_match, patterns, selector


class Drop(Rule, frozen=True, tag="drop"):
    match: Match

    def __post_init__(self):
        selector(patterns(self.match), 'A `drop` rule: "match"')

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def drop(v: Virtual) -> list[Virtual]:
            ctx.dropped.append(v)
            return []

        return each_matched(self.match, 'A `drop` rule: "match"', virtuals, ctx, drop)


class Ignore(Rule, frozen=True, tag="ignore"):
    match: Match

    def __post_init__(self):
        selector(patterns(self.match), 'An `ignore` rule: "match"')

    def ignores(self, name: str) -> bool:
        selected = selector(patterns(self.match), 'An `ignore` rule: "match"')
        return first_match(selected, name) is not None

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        return virtuals  # the planner asks `ignores` when it compares tensors
