"""How the planner words what it found: problems grouped the way a person
fixes them (a missing layer as one, layers past a stack's end as one), each
naming the tensor and the leaf, and the fixes after them."""

from .._errors import bullet_list, some
from .stage import Context, Virtual, examples
from .transforms.base import FIX_UNMATCHED
from .transforms.stack import Stack

_FIX_SHAPE = (
    "If the model's hyperparameters differ (sizes, heads, layers), build the "
    "skeleton with the ones the tensors were made with; if the layout holds the "
    "axes in another order, add a `transpose` rule; if it fuses or splits "
    "tensors, check the `split`/`fuse` sizes."
)
_FIX_MISSING = (
    "Build the skeleton of the model the tensors hold (its number of layers), "
    "fix the mapping's names (each problem names the leaf it maps), or `drop` "
    "leaves the tensors do not have (their values then come from the skeleton)."
)
_FIX_UNEXPECTED = (
    "To leave such tensors out, add an `ignore` rule for them (buffers such as "
    "`attn.bias` or `rotary_emb.inv_freq`), or pass `allow_unused=True`."
)


def report_shapes(shapes, virtuals, ctx: Context) -> None:
    wrong = {v.name for v, _ in shapes}
    for v, t in shapes:
        why = ""
        if sorted(t.shape) == sorted(v.shape) and len(v.shape) > 1:
            why = " (the same axes in another order: a `transpose` rule may be missing)"
        elif v.layers:
            siblings = [
                u for u in virtuals if u.leaves == v.leaves and u.name not in wrong
            ]
            if siblings:
                why = (
                    f" (an uneven stack: {examples([u.name for u in siblings], 1)} and "
                    "other layers have the expected shape)"
                )
        ctx.problem(
            f"Tensor `{v.name}` ({ctx.origin(v)}) has shape {t.shape} in the "
            f"tensors, but the mapping makes {v.shape} of the skeleton{why}.",
            _FIX_SHAPE,
        )


def report_missing(missing, virtuals, ctx: Context) -> None:
    if not missing:
        return
    per_layer: dict[tuple, int] = {}
    for v in virtuals:
        if v.layers:
            per_layer[v.layers] = per_layer.get(v.layers, 0) + 1
    groups: dict[tuple, list[Virtual]] = {}
    for v in missing:
        groups.setdefault(v.layers, []).append(v)
    for layers, group in groups.items():
        if layers and len(group) > 1 and len(group) == per_layer[layers]:
            index = ", ".join(".".join(map(str, idx)) for _, idx in layers)
            ctx.problem(
                f"Layer {index} is missing from the tensors: none of its "
                f"{len(group)} tensors is there ({examples([v.name for v in group])}"
                f"; from {_leaves(group, ctx)}).",
                _FIX_MISSING,
            )
            continue
        for v in group:
            ctx.problem(
                f"Tensor `{v.name}` ({ctx.origin(v)}) is missing from the tensors.",
                _FIX_MISSING,
            )


def _leaves(group: list[Virtual], ctx: Context) -> str:
    names = list(dict.fromkeys(n for v in group for n in v.leaves))
    shown = some([ctx.labels.get(n, f"`{n}`") for n in names])
    return ("leaf " if len(names) == 1 else "leaves ") + shown


def report_unexpected(names, mapping, virtuals, ctx: Context) -> None:
    if not names:
        return
    beyond = _beyond_stacks(names, mapping, virtuals)
    for (label, count, index), group in beyond.items():
        ctx.problem(
            f"Layer {index} is in the tensors ({_count(len(group))}, "
            f"{examples(group)}), but the skeleton stacks {count} layers at "
            f"`{label}` (0 to {count - 1}).",
            "Build the skeleton with the number of layers the tensors hold.",
        )
    listed = {n for group in beyond.values() for n in group}
    for name in names:
        if name not in listed:
            ctx.problem(
                f"Tensor `{name}` is in the tensors, but no leaf maps to it.",
                _FIX_UNEXPECTED,
            )


def _beyond_stacks(names, mapping, virtuals) -> dict[tuple, list[str]]:
    """Unexpected tensors that are layers past a stack's end, by layer."""
    out: dict[tuple, list[str]] = {}
    for i, rule in enumerate(mapping.rules):
        if not isinstance(rule, Stack) or len(rule.new_holes) != 1:
            continue
        count = 1 + max(
            (idx[0] for v in virtuals for r, idx in v.layers if r == i), default=-1
        )
        target = rule._target
        for name in names:
            m = target.prefix.fullmatch(name)
            if m is None:
                continue
            index = int(m.group(rule.new_holes[0]))
            if index >= count:
                out.setdefault((rule.label(), count, index), []).append(name)
    return out


def message(head: str, ctx: Context) -> str:
    n = len(ctx.problems)
    fixes = list(ctx.fixes)
    if FIX_UNMATCHED in fixes:  # the other fixes are about the names they make
        fixes.remove(FIX_UNMATCHED)
        fixes.insert(0, FIX_UNMATCHED)
    return "\n".join(
        [
            f"{head} ({n} problem{'s' if n != 1 else ''}):",
            bullet_list(ctx.problems),
            *fixes,
        ]
    )


def _count(n: int) -> str:
    return f"{n} tensor{'s' if n != 1 else ''}"
