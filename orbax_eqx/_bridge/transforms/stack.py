"""`stack`: a leading layer axis of leaves ⇄ one tensor per layer.

`{"op": "stack", "from": "blocks", "to": "h.{i}"}`: every leaf under
`blocks` (a scanned stack, made with `eqx.filter_vmap`) has the layers on its
first axis; `blocks.attn.w` of shape (L, ...) becomes the tensors
`h.0.attn.w` ... `h.{L-1}.attn.w` of shape (...). Each hole of `to` that
`from` lacks takes one leading axis, in the order the holes appear in `to`:
`"to": "g.{i}.l.{j}"` unstacks two axes. Holes of `from` (left by an earlier
stack) are carried over, so stacks nest: `stack("groups", "g.{i}")` then
`stack("g.{i}.layers", "g.{i}.l.{j}")`.

Inverse: the layers' tensors, stacked along the leading axis (a load reads
each layer's tensor into its row of the leaf).
"""

import dataclasses
import itertools
from typing import Any

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual, cut, drop_leading
from . import schema
from .base import Rule, quote, unmatched

MAX_LAYERS = 1 << 20  # tensors one leaf may unstack into


@dataclasses.dataclass(frozen=True)
class Stack(Rule):
    op = "stack"
    source: str
    target: str
    _source: templates.Template = dataclasses.field(
        init=False, repr=False, compare=False
    )
    _target: templates.Template = dataclasses.field(
        init=False, repr=False, compare=False
    )
    new_holes: tuple[str, ...] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self):
        where = f"The `stack` rule {self.label()}"
        source = schema.template(self.source, f'{where}: "from"', wildcards=False)
        target = schema.template(self.target, f'{where}: "to"', wildcards=False)
        lost = set(source.holes) - set(target.holes)
        if lost:
            raise MappingError(
                f'{where}: "to" lacks the hole `{{{sorted(lost)[0]}}}` of "from": '
                "every index a name holds must stay in it."
            )
        new = tuple(h for h in target.holes if h not in source.holes)
        if not new:
            raise MappingError(
                f'{where}: "to" has no new hole like `{{i}}` for the layer index.'
            )
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "new_holes", new)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "from": self.source, "to": self.target}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Stack":
        schema.keys(data, where, {"from", "to"})
        return cls(
            schema.string(data["from"], f'{where}: "from"'),
            schema.string(data["to"], f'{where}: "to"'),
        )

    def label(self) -> str:
        return f".stack({quote(self.source)}, {quote(self.target)})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        source, target = self._source, self._target
        k = len(self.new_holes)
        matched = False
        out = []
        for v in virtuals:
            m = source.prefix.fullmatch(v.name)
            if m is None:
                out.append(v)
                continue
            matched = True
            if len(v.shape) < k:
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) has shape {v.shape}, but "
                    f"{ctx.at_rule()} unstacks {k} leading layer "
                    f"ax{'is' if k == 1 else 'es'} from it.",
                    "Stack only leaves that have the layer axes first (made with "
                    '`eqx.filter_vmap`); leave others out of the rule\'s "from".',
                )
                out.append(v)
                continue
            layers = v.shape[:k]
            count = 1
            for n in layers:
                count *= n
            if count > MAX_LAYERS:
                ctx.problem(
                    f"`{v.name}` ({ctx.origin(v)}) would unstack into {count} "
                    f"tensors at {ctx.at_rule()}, more than the {MAX_LAYERS} allowed."
                )
                out.append(v)
                continue
            binding = templates.binding(m, source.holes)
            rest = m.group("_rest")
            rest_box = tuple((0, n) for n in v.shape[k:])
            for index in itertools.product(*(range(n) for n in layers)):
                named = binding | dict(zip(self.new_holes, index, strict=False))
                name = target.render(named)
                if rest is not None:
                    name = f"{name}.{rest}"
                box = tuple((i, i + 1) for i in index) + rest_box
                pieces = tuple(drop_leading(p, k) for p in cut(v.pieces, box))
                out.append(
                    Virtual(
                        name,
                        v.shape[k:],
                        v.dtype,
                        pieces,
                        v.leaves,
                        v.layers + ((ctx.rule, index),),
                    )
                )
        if not matched:
            unmatched(ctx, f'"from" {quote(self.source)}', [v.name for v in virtuals])
        return out
