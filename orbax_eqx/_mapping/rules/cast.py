"""`cast`: the dtype a tensor is written in.

`{"op": "cast", "match": "**", "dtype": "bfloat16"}`: the tensors matched are
written in that dtype (`to_state_dict`, exports). Loading reads them into
the leaves' own dtypes: a tensor in the dtype the mapping says is expected,
not a mismatch (any other dtype needs `cast=True`).

Inverse: the cast back to the leaf's dtype, which readers do once, after
placing the values.
"""

from typing import Literal

from ..stage import Context, Virtual
from .base import Match, Rule, each_matched, patterns, selector

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
_WHERE = 'A `cast` rule: "match"'


class Cast(Rule, frozen=True, tag="cast"):
    match: Match
    dtype: Dtype

    def __post_init__(self):
        selector(patterns(self.match), _WHERE)

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        return each_matched(
            self.match, _WHERE, virtuals, ctx, lambda v: [v.but(dtype=self.dtype)]
        )
