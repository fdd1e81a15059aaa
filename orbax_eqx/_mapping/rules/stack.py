"""`stack`: a leading layer axis of the leaves under `"from"` ⇄ one tensor per
layer (`{"op": "stack", "from": "blocks", "to": "h.{i}"}`): each new hole of
`"to"` takes one leading axis, holes of `"from"` are carried over, so stacks
nest. Inverse: each layer's tensor read into its row of the leaf."""

import functools
import itertools

import msgspec

from .. import templates
from ..errors import MappingError
from ..pieces import Piece
from ..stage import Context, Virtual, cut, drop_leading, natural, whole
from .base import Rule, Text, template, unmatched

MAX_LAYERS = 1 << 20  # tensors one leaf may unstack into


class Stack(Rule, frozen=True, tag="stack"):
    source: Text = msgspec.field(name="from")
    target: Text = msgspec.field(name="to")

    def __post_init__(self):
        _parsed(self.source, self.target)

    @property
    def templates(self) -> tuple[templates.Template, templates.Template]:
        """The `from` and `to` templates."""
        return _parsed(self.source, self.target)[:2]

    @property
    def new_holes(self) -> tuple[str, ...]:
        """The holes of `to` that `from` lacks: one per unstacked axis."""
        return _parsed(self.source, self.target)[2]

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        source, target = self.templates
        new_holes = self.new_holes
        k = len(new_holes)
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
            tail = "" if rest is None else f".{rest}"
            out.extend(_unstacked(v, k, layers, binding, new_holes, target, tail, ctx))
        if not matched:
            unmatched(ctx, f'"from" {self.source!r}', [v.name for v in virtuals])
        return out


def _unstacked(v, k, layers, binding, new_holes, target, tail, ctx) -> list[Virtual]:
    """One virtual per layer of `v`, in order. (The hot loop of a deep stack:
    a million layers are a million of these, so each is a few objects: its
    name, its piece and its boxes, the virtual.)"""
    rest_shape = v.shape[k:]
    rest_box = tuple((0, n) for n in rest_shape)
    p = v.pieces[0] if len(v.pieces) == 1 else None
    # The usual case, cut without clipping: one piece, the whole leaf as it is.
    plain = (
        p is not None
        and p.tensor_box == p.leaf_box == whole(v.shape)
        and p.perm == tuple(range(len(p.perm)))
    )
    if plain and k == 1:
        assert p is not None
        hole = new_holes[0]
        return _unstacked_plain(v, p, layers[0], binding, hole, target, tail, ctx)
    perm_rest = tuple(range(len(rest_shape)))
    out = []
    for index in itertools.product(*(range(n) for n in layers)):
        named = binding | dict(zip(new_holes, index, strict=True))
        name = target.render(named) + tail
        box = tuple((i, i + 1) for i in index) + rest_box
        if plain:
            assert p is not None
            pieces: tuple = (Piece(p.leaf, box, p.tensor, rest_box, perm_rest),)
        else:
            pieces = tuple(drop_leading(q, k) for q in cut(v.pieces, box))
        out.append(
            Virtual(
                name,
                rest_shape,
                v.dtype,
                pieces,
                v.leaves,
                v.layers + ((ctx.rule, index),),
            )
        )
    return out


def _unstacked_plain(v, p, count, binding, hole, target, tail, ctx) -> list[Virtual]:
    """`_unstacked` of one leading axis of a leaf as it is: names from the text
    around the hole, one piece a layer."""
    head, after = _around(target, binding, hole)
    after += tail
    rest_shape = v.shape[1:]
    rest_box = tuple((0, n) for n in rest_shape)
    perm = tuple(range(len(rest_shape)))
    leaf, dtype, leaves = p.leaf, v.dtype, v.leaves
    layers, rule = v.layers, ctx.rule
    # A hole sits between text that is not digits, so the name's sort key is
    # the key of the text before it, the index, then the key of the text after.
    before, behind = natural(head), natural(after)
    out = []
    for i in range(count):
        name = f"{head}{i}{after}"
        # The piece names its tensor already: the plan keeps it if no later
        # rule renames the tensor.
        piece = Piece(leaf, ((i, i + 1), *rest_box), name, rest_box, perm)
        out.append(
            Virtual(
                name,
                rest_shape,
                dtype,
                (piece,),
                leaves,
                (*layers, (rule, (i,))),
                (*before, i, *behind),
            )
        )
    return out


def _around(target: templates.Template, binding: dict, hole: str) -> tuple[str, str]:
    """The text `target` renders before and after `hole`, with `binding`."""
    head: list[str] = []
    after: list[str] = []
    side = head
    for kind, value in target.tokens:
        if kind == "hole" and value == hole:
            side = after
        else:
            side.append(str(binding[value]) if kind == "hole" else value)
    return "".join(head), "".join(after)


@functools.lru_cache(maxsize=256)
def _parsed(source_text: str, target_text: str):
    where = f"The `stack` rule from {source_text!r} to {target_text!r}"
    source = template(source_text, f'{where}: "from"', wildcards=False)
    target = template(target_text, f'{where}: "to"', wildcards=False)
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
    return source, target, new
