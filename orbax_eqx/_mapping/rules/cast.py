"""`cast`: the dtype a tensor is written in (`{"op": "cast", "match": "**",
"dtype": "bfloat16"}`); loads expect it, and cast back to the leaves' own
dtypes once the values are placed (the inverse)."""

from typing import Literal

from ..stage import Context, Virtual
from .base import Match, Rule, each_matched

# Dtypes a tensor may be cast to: what safetensors and PyTorch hold, by their
# numpy (ml_dtypes) names.
Dtype = Literal[
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
]


class Cast(Rule, frozen=True, tag="cast"):
    match: Match
    dtype: Dtype

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        return each_matched(self, virtuals, ctx, lambda v: [v.but(dtype=self.dtype)])
