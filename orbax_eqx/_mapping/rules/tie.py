"""`tie`: a tensor that is a copy of another (`lm_head.weight` of `wte.weight`):
a load checks it holds the same values; with `"export": true` exports write
it. Inverse: reading `"to"`."""

from .base import Rule, Text


class Tie(Rule, frozen=True, tag="tie"):
    tensor: Text
    to: Text
    export: bool = False

    def apply(self, virtuals, ctx):
        return virtuals  # the planner adds ties once the tensors are known
