"""`drop` and `ignore`: what one side has and the other does not.

`{"op": "drop", "match": "rope.freqs"}`: leaves left out of the tensors (a
table a model rebuilds itself). On a load they are not read: the skeleton
must hold their values (a concrete array, not a `jax.ShapeDtypeStruct`).

`{"op": "ignore", "match": ["h.{i}.attn.bias", "**.rotary_emb.inv_freq"]}`:
tensors a load leaves alone (buffers PyTorch saves beside the weights, like
GPT-2's causal masks). It matches the final tensor names, wherever it is in
the mapping, and matching nothing is no error (files differ in which buffers
they keep). Exports ignore it.
"""

import dataclasses
from typing import Any

from ..stage import Context, Virtual
from . import schema
from .base import Rule, Selector, each_matched


@dataclasses.dataclass(frozen=True)
class Drop(Rule):
    op = "drop"
    match: tuple[str, ...]
    _selector: Selector = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self, "_selector", Selector(self.match, 'A `drop` rule: "match"')
        )

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "match": self._selector.json()}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Drop":
        schema.keys(data, where, {"match"})
        return cls(schema.strings(data["match"], f'{where}: "match"'))

    def label(self) -> str:
        return f".drop({self._selector.shown()})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        def drop(v: Virtual) -> list[Virtual]:
            ctx.dropped.append(v)
            return []

        return each_matched(self._selector, virtuals, ctx, drop)


@dataclasses.dataclass(frozen=True)
class Ignore(Rule):
    op = "ignore"
    match: tuple[str, ...]
    _selector: Selector = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self, "_selector", Selector(self.match, 'An `ignore` rule: "match"')
        )

    @property
    def selector(self) -> Selector:
        return self._selector

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "match": self.selector.json()}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Ignore":
        schema.keys(data, where, {"match"})
        return cls(schema.strings(data["match"], f'{where}: "match"'))

    def label(self) -> str:
        return f".ignore({self.selector.shown()})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        return virtuals  # the planner asks `selector` when it compares tensors
