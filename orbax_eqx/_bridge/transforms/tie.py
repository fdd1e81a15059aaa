"""`tie`: a tensor that is a copy of another (a tied output head).

`{"op": "tie", "tensor": "lm_head.weight", "to": "wte.weight", "export":
false}`: Hugging Face ties GPT-2's `lm_head.weight` to `wte.weight`, and its
files hold it or not. A load accepts it when it is there, and checks that
it holds the same values as `to` (an untied head of other values is an
error, not silently dropped); with `"export": true`, exports write it too,
as a copy of `to` (what `model.state_dict()` of a PyTorch model holds).

Inverse: reading `to` (the copy adds no values).
"""

import dataclasses
from typing import Any

from ..errors import MappingError
from . import schema
from .base import Rule, quote


@dataclasses.dataclass(frozen=True)
class Tie(Rule):
    op = "tie"
    tensor: str
    to: str
    export: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "tensor": self.tensor,
            "to": self.to,
            "export": self.export,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Tie":
        schema.keys(data, where, {"tensor", "to"}, {"export"})
        export = data.get("export", False)
        if not isinstance(export, bool):
            raise MappingError(
                f'{where}: "export" must be true or false, not {schema._kind(export)}.'
            )
        return cls(
            schema.string(data["tensor"], f'{where}: "tensor"'),
            schema.string(data["to"], f'{where}: "to"'),
            export,
        )

    def label(self) -> str:
        export = ", export=True" if self.export else ""
        return f".tie({quote(self.tensor)}, {quote(self.to)}{export})"

    def apply(self, virtuals, ctx):
        return virtuals  # the planner adds ties once the tensors are known
