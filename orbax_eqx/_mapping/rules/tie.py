"""`tie`: a tensor that is a copy of another (a tied output head).

`{"op": "tie", "tensor": "lm_head.weight", "to": "wte.weight", "export":
false}`: Hugging Face ties GPT-2's `lm_head.weight` to `wte.weight`, and its
files hold it or not. A load accepts it when it is there, and checks that
it holds the same values as `to` (an untied head of other values is an
error, not silently dropped); with `"export": true`, exports write it too,
as a copy of `to` (what `model.state_dict()` of a PyTorch model holds).

Inverse: reading `to` (the copy adds no values).
"""

from .base import Rule, Text


class Tie(Rule, frozen=True, tag="tie"):
    tensor: Text
    to: Text
    export: bool = False

    def apply(self, virtuals, ctx):
        return virtuals  # the planner adds ties once the tensors are known
