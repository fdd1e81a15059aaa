"""`split`: one tensor is several, its parts along `"axis"` (`"sizes"`, or equal
parts with `null`); the names of `"into"` repeat the holes of `"match"`.
Inverse: the parts fused again."""

import functools
from typing import Annotated

import msgspec

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual, cut, shift, whole
from .base import MAX_PARTS, Axis, Rule, Size, Text, template, unmatched

FIX_AXIS = "Give `split` and `fuse` an axis the tensors have (negative counts back)."
FIX_SIZES = (
    "Give `split` the size of each part along its axis (`sizes=`: they must add "
    "up to the axis; unequal for grouped-query attention, such as "
    "`sizes=[heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]`), or "
    "check the skeleton's hyperparameters (heads, key/value heads)."
)


def axis_of(axis: int, rank: int) -> int | None:
    if -rank <= axis < rank:
        return axis % rank
    return None


class Split(Rule, frozen=True, tag="split"):
    match: Text
    axis: Axis
    into: Annotated[list[Text], msgspec.Meta(min_length=2, max_length=MAX_PARTS)]
    sizes: Annotated[list[Size], msgspec.Meta(max_length=MAX_PARTS)] | None = None

    def __post_init__(self):
        _parsed(self.match, tuple(self.into))
        if self.sizes is not None and len(self.sizes) != len(self.into):
            raise MappingError(
                f'The `split` rule of {self.match!r}: "sizes" has {len(self.sizes)} '
                f'entries for the {len(self.into)} names of "into".'
            )

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        source, parts = _parsed(self.match, tuple(self.into))
        matched = False
        out = []
        for v in virtuals:
            m = source.whole.fullmatch(v.name)
            if m is None:
                out.append(v)
                continue
            matched = True
            binding = templates.binding(m, source.holes)
            names = [t.render(binding) for t in parts]
            cut_at = self._sizes(v, ctx)
            if cut_at is None:  # reported; its parts are not reported again
                ctx.explained.update([v.name, *names])
                out.append(v)
                continue
            axis, sizes = cut_at
            if self.sizes is None:
                ctx.equal_parts.update(names)
            start = 0
            for name, size in zip(names, sizes, strict=True):
                box = list(whole(v.shape))
                box[axis] = (start, start + size)
                shape = list(v.shape)
                shape[axis] = size
                pieces = tuple(
                    shift(p, axis, -start) for p in cut(v.pieces, tuple(box))
                )
                out.append(v.but(name=name, shape=tuple(shape), pieces=pieces))
                start += size
        if not matched:
            unmatched(ctx, f'"match" {self.match!r}', [v.name for v in virtuals])
        return out

    def _sizes(self, v: Virtual, ctx: Context) -> tuple[int, list[int]] | None:
        """The axis and the parts' sizes along it; None (a problem) if they do
        not fit `v`."""
        axis = axis_of(self.axis, len(v.shape))
        if axis is None:
            ctx.problem(
                f"`{v.name}` ({ctx.origin(v)}) has shape {v.shape}: no axis "
                f"{self.axis} to split at {ctx.at_rule()}.",
                FIX_AXIS,
            )
            return None
        n = v.shape[axis]
        if self.sizes is None:
            if n % len(self.into):
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) has {n} along axis {axis}, which "
                    f"{ctx.at_rule()} cannot split into {len(self.into)} equal parts.",
                    FIX_SIZES,
                )
                return None
            return axis, [n // len(self.into)] * len(self.into)
        if sum(self.sizes) != n:
            ctx.problem(
                f"`{v.name}` ({ctx.origin(v)}) has {n} along axis {axis}, but the "
                f"sizes {list(self.sizes)} of {ctx.at_rule()} sum to "
                f"{sum(self.sizes)}.",
                FIX_SIZES,
            )
            return None
        return axis, list(self.sizes)


@functools.lru_cache(maxsize=256)
def _parsed(match: str, into: tuple[str, ...]):
    where = f"The `split` rule of {match!r}"
    source = template(match, f'{where}: "match"', wildcards=True)
    parts = []
    for i, name in enumerate(into):
        t = template(name, f'{where}: "into"[{i}]', wildcards=False)
        extra = set(t.holes) - set(source.holes)
        if extra:
            raise MappingError(
                f'{where}: "into"[{i}] {name!r} has the hole '
                f'`{{{sorted(extra)[0]}}}`, which "match" lacks.'
            )
        parts.append(t)
    return source, tuple(parts)
