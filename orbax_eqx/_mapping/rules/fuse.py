"""`fuse`: several tensors are one, concatenated along `"axis"` in the order of
`"parts"` (GPT-2's `c_attn`). Inverse: the tensor split into its parts."""

import functools
from typing import Annotated

import msgspec

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual, shift
from .base import MAX_PARTS, Axis, Rule, Text, template, unmatched
from .split import axis_of


class Fuse(Rule, frozen=True, tag="fuse"):
    parts: Annotated[list[Text], msgspec.Meta(min_length=2, max_length=MAX_PARTS)]
    axis: Axis
    into: Text

    def __post_init__(self):
        _parsed(tuple(self.parts), self.into)

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        parts, into = _parsed(tuple(self.parts), self.into)
        groups, taken = _groups(virtuals, parts, ctx)
        _orphans(virtuals, parts, taken, ctx)
        if not groups:
            names = list(dict.fromkeys(v.name for v in virtuals))
            unmatched(ctx, f'"parts"[0] {self.parts[0]!r}', names)
        out = []
        for i, v in enumerate(virtuals):
            if i in groups:
                fused = self._fuse([virtuals[j] for j in groups[i]], parts, into, ctx)
                if fused is not None:
                    out.append(fused)
                    continue
                out.extend(virtuals[j] for j in groups[i])
            elif i not in taken:
                out.append(v)
        return out

    def _fuse(self, members, parts, into, ctx: Context) -> Virtual | None:
        """The members as one virtual, or None (and a problem) if they differ
        off the fused axis."""
        first = members[0]
        m = parts[0].whole.fullmatch(first.name)
        assert m is not None  # `apply` grouped the members by this match
        name = into.render(templates.binding(m, parts[0].holes))
        axis = axis_of(self.axis, len(first.shape))

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


_FIX = (
    'Fuse only tensors that all exist: check the names of "parts" against what '
    "the rules before make."
)


def _groups(virtuals: list[Virtual], parts, ctx: Context):
    """`{position of a first part: positions of its parts}`, and `{position of
    a part: position of its first}`; a first part without the others is a
    problem."""
    holes = parts[0].holes
    by_name = {v.name: i for i, v in enumerate(virtuals)}
    taken: dict[int, int] = {}
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
                _FIX,
            )
            continue
        groups[i] = [by_name[n] for n in names]
        taken.update((j, i) for j in groups[i])
    return groups, taken


def _orphans(virtuals: list[Virtual], parts, taken: dict, ctx: Context) -> None:
    """Parts left without their first: named, not silently kept."""
    for i, v in enumerate(virtuals):
        if i in taken:
            continue
        for k, t in enumerate(parts[1:], 1):
            m = t.whole.fullmatch(v.name)
            if m is not None:
                first = parts[0].render(templates.binding(m, parts[0].holes))
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) is part {k} of "
                    f"{ctx.at_rule()}, but there is no `{first}` to fuse it with.",
                    _FIX,
                )


def _names(names: list[str]) -> str:
    return " or ".join(f"`{n}`" for n in names[:3]) + (
        f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    )


@functools.lru_cache(maxsize=256)
def _parsed(names: tuple[str, ...], into_text: str):
    where = f"The `fuse` rule into {into_text!r}"
    parts = [
        template(p, f'{where}: "parts"[{i}]', wildcards=False)
        for i, p in enumerate(names)
    ]
    holes = set(parts[0].holes)
    for i, t in enumerate(parts[1:], 1):
        if set(t.holes) != holes:
            raise MappingError(
                f'{where}: "parts"[{i}] {names[i]!r} has other holes than '
                f'"parts"[0] {names[0]!r}: every part must have the same.'
            )
    into = template(into_text, f'{where}: "into"', wildcards=False)
    if set(into.holes) != holes:
        raise MappingError(
            f'{where}: "into" must have the holes of its parts, '
            f"{sorted(holes) or 'none'}."
        )
    return tuple(parts), into
