"""`split` and `fuse`: one tensor ⇄ several, along an axis. Each is the
other's inverse.

`{"op": "split", "match": "model.layers.{i}.self_attn.qkv_proj.weight",
"axis": 0, "into": ["model.layers.{i}.self_attn.q_proj.weight", ...],
"sizes": [64, 16, 16]}`: the parts, in order along `axis`, of the sizes
given (unequal ones for grouped-query attention), or equal parts with
`"sizes": null`. The names of `into` repeat the holes of `match`.

`{"op": "fuse", "parts": ["h.{i}.attn.q.weight", "h.{i}.attn.k.weight",
"h.{i}.attn.v.weight"], "axis": 1, "into": "h.{i}.attn.c_attn.weight"}`:
the parts, concatenated along `axis` in the order given, are one tensor.
Parts take no wildcards: each name is found from the first part's holes.
"""

import dataclasses
from typing import Any

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual, cut, shift, whole
from . import schema
from .base import Rule, Selector, quote, unmatched


def _axis(axis: int, rank: int) -> int | None:
    if -rank <= axis < rank:
        return axis % rank
    return None


@dataclasses.dataclass(frozen=True)
class Split(Rule):
    op = "split"
    match: str
    axis: int
    into: tuple[str, ...]
    sizes: tuple[int, ...] | None = None
    _selector: Selector = dataclasses.field(init=False, repr=False, compare=False)
    _parts: list[templates.Template] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self):
        where = f"The `split` rule of {quote(self.match)}"
        selector = Selector((self.match,), f'{where}: "match"')
        holes = set(selector.templates[0].holes)
        if len(self.into) < 2:
            raise MappingError(f'{where}: "into" must name at least two parts.')
        parts = []
        for i, name in enumerate(self.into):
            t = schema.template(name, f'{where}: "into"[{i}]', wildcards=False)
            extra = set(t.holes) - holes
            if extra:
                raise MappingError(
                    f'{where}: "into"[{i}] {name!r} has the hole '
                    f'`{{{sorted(extra)[0]}}}`, which "match" lacks.'
                )
            parts.append(t)
        if self.sizes is not None and len(self.sizes) != len(self.into):
            raise MappingError(
                f'{where}: "sizes" has {len(self.sizes)} entries for the '
                f'{len(self.into)} names of "into".'
            )
        object.__setattr__(self, "_selector", selector)
        object.__setattr__(self, "_parts", parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "match": self.match,
            "axis": self.axis,
            "into": list(self.into),
            "sizes": None if self.sizes is None else list(self.sizes),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Split":
        schema.keys(data, where, {"match", "axis", "into"}, {"sizes"})
        into = schema.sequence(data["into"], f'{where}: "into"')
        sizes = data.get("sizes")
        if sizes is not None:
            sizes = tuple(
                schema.integer(n, f'{where}: "sizes"[{i}]', 0, schema.MAX_SIZE)
                for i, n in enumerate(schema.sequence(sizes, f'{where}: "sizes"'))
            )
        return cls(
            schema.string(data["match"], f'{where}: "match"'),
            schema.integer(
                data["axis"], f'{where}: "axis"', -schema.MAX_RANK, schema.MAX_RANK - 1
            ),
            tuple(
                schema.string(n, f'{where}: "into"[{i}]') for i, n in enumerate(into)
            ),
            sizes,
        )

    def label(self) -> str:
        into = ", ".join(quote(n) for n in self.into)
        sizes = "" if self.sizes is None else f", sizes={list(self.sizes)}"
        return f".split({quote(self.match)}, [{into}], axis={self.axis}{sizes})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        selector: Selector = self._selector
        holes = selector.templates[0].holes
        matched = False
        out = []
        for v in virtuals:
            found = selector.match(v.name)
            if found is None:
                out.append(v)
                continue
            matched = True
            axis = _axis(self.axis, len(v.shape))
            if axis is None:
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) has shape {v.shape}: no axis "
                    f"{self.axis} to split at {ctx.at_rule()}.",
                    _FIX_AXIS,
                )
                out.append(v)
                continue
            n = v.shape[axis]
            sizes = self.sizes
            if sizes is None:
                if n % len(self.into):
                    ctx.problem(
                        f"`{v.name}` ({ctx.origin(v)}) has {n} along axis {axis}, "
                        f"which {ctx.at_rule()} cannot split into {len(self.into)} "
                        "equal parts.",
                        _FIX_SIZES,
                    )
                    out.append(v)
                    continue
                sizes = (n // len(self.into),) * len(self.into)
            if sum(sizes) != n:
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) has {n} along axis {axis}, but "
                    f"the sizes {list(sizes)} of {ctx.at_rule()} sum to {sum(sizes)}.",
                    _FIX_SIZES,
                )
                out.append(v)
                continue
            binding = templates.binding(found[1], holes)
            start = 0
            for part, size in zip(self._parts, sizes, strict=True):
                box = list(whole(v.shape))
                box[axis] = (start, start + size)
                shape = list(v.shape)
                shape[axis] = size
                pieces = tuple(
                    shift(p, axis, -start) for p in cut(v.pieces, tuple(box))
                )
                out.append(
                    dataclasses.replace(
                        v, name=part.render(binding), shape=tuple(shape), pieces=pieces
                    )
                )
                start += size
        if not matched:
            unmatched(ctx, f'"match" {quote(self.match)}', [v.name for v in virtuals])
        return out


_FIX_AXIS = "Give `split` and `fuse` an axis the tensors have (negative counts back)."
_FIX_SIZES = (
    "Give `split` the size of each part along its axis (they must add up to the "
    "axis), or check the skeleton's hyperparameters (heads, key/value heads)."
)


@dataclasses.dataclass(frozen=True)
class Fuse(Rule):
    op = "fuse"
    parts: tuple[str, ...]
    axis: int
    into: str
    _parts: list[templates.Template] = dataclasses.field(
        init=False, repr=False, compare=False
    )
    _into: templates.Template = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        where = f"The `fuse` rule into {quote(self.into)}"
        if len(self.parts) < 2:
            raise MappingError(f'{where}: "parts" must name at least two tensors.')
        parts = [
            schema.template(p, f'{where}: "parts"[{i}]', wildcards=False)
            for i, p in enumerate(self.parts)
        ]
        holes = set(parts[0].holes)
        for i, t in enumerate(parts[1:], 1):
            if set(t.holes) != holes:
                raise MappingError(
                    f'{where}: "parts"[{i}] {self.parts[i]!r} has other holes than '
                    f'"parts"[0] {self.parts[0]!r}: every part must have the same.'
                )
        into = schema.template(self.into, f'{where}: "into"', wildcards=False)
        if set(into.holes) != holes:
            raise MappingError(
                f'{where}: "into" must have the holes of its parts, '
                f"{sorted(holes) or 'none'}."
            )
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_into", into)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "parts": list(self.parts),
            "axis": self.axis,
            "into": self.into,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Fuse":
        schema.keys(data, where, {"parts", "axis", "into"})
        parts = schema.sequence(data["parts"], f'{where}: "parts"')
        return cls(
            tuple(
                schema.string(p, f'{where}: "parts"[{i}]') for i, p in enumerate(parts)
            ),
            schema.integer(
                data["axis"], f'{where}: "axis"', -schema.MAX_RANK, schema.MAX_RANK - 1
            ),
            schema.string(data["into"], f'{where}: "into"'),
        )

    def label(self) -> str:
        parts = ", ".join(quote(p) for p in self.parts)
        return f".fuse([{parts}], {quote(self.into)}, axis={self.axis})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        parts = self._parts
        holes = parts[0].holes
        by_name = {v.name: i for i, v in enumerate(virtuals)}
        taken: dict[int, int] = {}  # position of a part -> position of its first
        groups: dict[int, list[int]] = {}
        for i, v in enumerate(virtuals):
            m = parts[0].whole.fullmatch(v.name)
            if m is None:
                continue
            binding = templates.binding(m, holes)
            names = [t.render(binding) for t in parts]
            missing = [n for n in names[1:] if n not in by_name]
            if missing:
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) is the first part of "
                    f"{ctx.at_rule()}, but there is no {_names(missing)} to fuse it "
                    "with.",
                    'Fuse only tensors that all exist: check the names of "parts" '
                    "against what the rules before make.",
                )
                continue
            members = [by_name[n] for n in names]
            groups[i] = members
            for j in members:
                taken[j] = i
        # Parts left without their first: named, not silently kept.
        for i, v in enumerate(virtuals):
            if i in taken:
                continue
            for k, t in enumerate(parts[1:], 1):
                m = t.whole.fullmatch(v.name)
                if m is not None:
                    first = parts[0].render(templates.binding(m, holes))
                    ctx.problem(
                        f"`{v.name}` ({ctx.origin(v)}) is part {k} of "
                        f"{ctx.at_rule()}, but there is no `{first}` to fuse it "
                        "with.",
                        "Fuse only tensors that all exist: check the names of "
                        '"parts" against what the rules before make.',
                    )
        if not groups:
            unmatched(ctx, f'"parts"[0] {quote(self.parts[0])}', list(by_name))
        out = []
        for i, v in enumerate(virtuals):
            if i in groups:
                fused = self._fuse([virtuals[j] for j in groups[i]], ctx)
                if fused is not None:
                    out.append(fused)
                    continue
                out.extend(virtuals[j] for j in groups[i])
            elif i not in taken:
                out.append(v)
        return out

    def _fuse(self, members: list[Virtual], ctx: Context) -> Virtual | None:
        """The members as one virtual, or None (and a problem) if they differ
        off the fused axis."""
        first = members[0]
        m = self._parts[0].whole.fullmatch(first.name)
        assert m is not None  # `apply` grouped the members by this match
        name = self._into.render(templates.binding(m, self._parts[0].holes))
        axis = _axis(self.axis, len(first.shape))

        def off_axis(v: Virtual) -> list[int]:
            return [n for a, n in enumerate(v.shape) if a != axis]

        if axis is None or any(
            len(v.shape) != len(first.shape)
            or off_axis(v) != off_axis(first)
            or v.dtype != first.dtype
            for v in members
        ):
            shown = ", ".join(f"`{v.name}` {v.dtype}{list(v.shape)}" for v in members)
            ctx.problem(
                f"{ctx.at_rule()} cannot fuse {shown} into `{name}` along axis "
                f"{self.axis}: the parts must have one dtype and the same shape "
                "but for that axis.",
                "Fuse parts of one dtype (cast them first, with `cast`) and one "
                "shape off the fused axis.",
            )
            return None
        pieces: list = []
        leaves: list[str] = []
        layers: list = []
        offset = 0
        for v in members:
            pieces.extend(shift(p, axis, offset) for p in v.pieces)
            offset += v.shape[axis]
            leaves.extend(n for n in v.leaves if n not in leaves)
            layers.extend(x for x in v.layers if x not in layers)
        shape = list(first.shape)
        shape[axis] = offset
        return Virtual(
            name, tuple(shape), first.dtype, tuple(pieces), tuple(leaves), tuple(layers)
        )


def _names(names: list[str]) -> str:
    return " or ".join(f"`{n}`" for n in names[:3]) + (
        f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    )
