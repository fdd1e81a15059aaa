"""`cast`: the dtype a tensor is written in.

`{"op": "cast", "match": "**", "dtype": "bfloat16"}`: the tensors matched are
written in that dtype (`to_state_dict`, exports). Loading reads them into
the leaves' own dtypes: a tensor in the dtype the mapping says is expected,
not a mismatch (any other dtype needs `cast=True`).

Inverse: the cast back to the leaf's dtype, which readers do once, after
placing the values.
"""

import dataclasses
from typing import Any

from ..errors import MappingError
from ..stage import Context, Virtual
from . import schema
from .base import Rule, Selector, each_matched, quote

# Dtypes a tensor may be cast to: what safetensors and PyTorch hold, by their
# numpy (ml_dtypes) names.
DTYPES = (
    "bool",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


@dataclasses.dataclass(frozen=True)
class Cast(Rule):
    op = "cast"
    match: tuple[str, ...]
    dtype: str
    _selector: Selector = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(
            self, "_selector", Selector(self.match, 'A `cast` rule: "match"')
        )
        if self.dtype not in DTYPES:
            raise MappingError(
                f"A `cast` rule casts to {self.dtype!r}: the dtype must be one of "
                f"{', '.join(DTYPES)}."
            )

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "match": self._selector.json(), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Cast":
        schema.keys(data, where, {"match", "dtype"})
        return cls(
            schema.strings(data["match"], f'{where}: "match"'),
            schema.string(data["dtype"], f'{where}: "dtype"'),
        )

    def label(self) -> str:
        return f".cast({self._selector.shown()}, {quote(self.dtype)})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        return each_matched(
            self._selector,
            virtuals,
            ctx,
            lambda v: [dataclasses.replace(v, dtype=self.dtype)],
        )
