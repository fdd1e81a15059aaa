"""How the planner words what it found, grouped as a person fixes it (a missing
layer as one, layers past a stack's end as one, alike dtypes as one line), a
missing tensor paired with a stored one of its shape ("did you mean"), then
the fixes, naming the options of a load or of `EqxRestore`."""

import difflib
import heapq
import math
import os
from collections.abc import Sequence

from .._errors import bullet_list, some
from .rules.base import FIX_UNMATCHED
from .rules.split import FIX_SIZES
from .rules.stack import Stack
from .stage import Context, Problem, Virtual, examples, label

_OPTIONS = {  # (the command line says a load's arguments as its flags)
    False: {
        "stored": "the tensors",
        "rename": "map tensor names to leaf names with `mapping=`",
        "allow_unused": "pass `allow_unused=True` to leave them out",
        "cast": "pass `cast=True` to cast tensors to the skeleton's dtypes",
    },
    True: {
        "stored": "the checkpoint",
        "rename": "map the skeleton's leaf names to the checkpoint's with `renames=`",
        "allow_unused": "pass `EqxRestore(..., strict=False)` to leave them unread",
        "cast": "pass `EqxRestore(..., cast=True)` to cast arrays to the skeleton's "
        "dtypes",
    },
}


def _say(ctx: Context, what: str) -> str:
    return _OPTIONS[ctx.restore][what]


FIX_SHAPE = (
    "If the model's hyperparameters differ (sizes, heads, layers), build the "
    "skeleton with the ones the tensors were made with; if the layout holds the "
    "axes in another order, add a `transpose` rule; if it fuses or splits "
    "tensors, check the `split`/`fuse` sizes."
)
FIX_RESHAPE = (
    "If the layout holds the same values in another shape, add a `reshape` rule "
    "(`squeeze` or `expand_dims` for axes of length 1)."
)
FIX_MISSING = (
    "Build the skeleton of the model the tensors hold (its number of layers), "
    "fix the mapping's names (each problem names the leaf it maps), or `drop` "
    "leaves the tensors do not have (their values then come from the skeleton)."
)
FIX_MISSING_BY_NAME = (
    "Build the skeleton of the model the tensors hold, or {rename} (each "
    "problem names the tensor a leaf reads)."
)
FIX_UNEXPECTED = (
    "To leave such tensors out, add an `ignore` rule for them (buffers such as "
    "`attn.bias` or `rotary_emb.inv_freq`), or {allow_unused}."
)
ALIKE = 4  # dtype problems alike from which they are one line


FIX_KEY = (
    "Typed PRNG keys are stored as their key data (`jax.random.key_data`), and "
    "never cast: give such tensors the key data of the skeleton's key type, or "
    'build the skeleton with the stored one (`jax.random.key(0, impl="rbg")`).'
)


def _expected(ctx: Context, what: str) -> str:
    return (
        f"the mapping makes {what} of the skeleton"
        if ctx.mapped
        else (f"the skeleton has {what}")
    )


def _expects(ctx: Context, dtype: str) -> str:
    return f"the mapping expects {dtype}" if ctx.mapped else f"the skeleton has {dtype}"


def _key(v: Virtual, ctx: Context) -> str:
    """`, a key array...` for a tensor of a typed PRNG key leaf, or nothing."""
    impl = ctx.key_of(v)
    if impl is None:
        return ""
    return f" (a {impl} key array, as its key data {v.dtype}{list(v.shape)})"


def report_shapes(shapes, virtuals, ctx: Context) -> None:
    wrong = {v.name for v, _ in shapes}
    for v, t in shapes:
        why, fix = _why_shape(v, t, virtuals, wrong)
        if v.name in ctx.equal_parts:
            why, fix = " (a part of a `split` into equal parts)", FIX_SIZES
        if ctx.key_of(v):
            why, fix = _key(v, ctx), FIX_KEY
        ctx.problem(
            f"Tensor `{v.name}`{ctx.of(v)} has shape {t.shape} in "
            f"{_say(ctx, 'stored')}, but {_expected(ctx, str(v.shape))}{why}.",
            fix,
            kind="differs",
        )


def _why_shape(v: Virtual, t, virtuals, wrong) -> tuple[str, str]:
    if sorted(t.shape) == sorted(v.shape) and len(v.shape) > 1:
        why = " (the same axes in another order: a `transpose` rule may be missing)"
        return why, FIX_SHAPE
    if [n for n in t.shape if n != 1] == [n for n in v.shape if n != 1]:
        why = " (the same axes but for axes of length 1: a `squeeze` or `expand_dims`"
        return why + " rule may be missing)", FIX_RESHAPE
    if math.prod(t.shape) == math.prod(v.shape):
        why = " (as many values: a `reshape` rule may be missing)"
        return why, FIX_RESHAPE
    if v.layers:
        siblings = [u for u in virtuals if u.leaves == v.leaves and u.name not in wrong]
        if siblings:
            why = (
                f" (an uneven stack: {examples([u.name for u in siblings], 1)} and "
                "other layers have the expected shape)"
            )
            return why, FIX_SHAPE
    return "", FIX_SHAPE


def report_dtypes(dtypes: list, total: int, ctx: Context) -> None:
    """Dtype problems: many alike (`bfloat16` tensors for a `float32`
    skeleton) as one line, first; the others one by one."""
    groups: dict[tuple[str, str], list] = {}
    for v, t in dtypes:
        groups.setdefault((t.dtype, v.dtype), []).append(v)
    for (found, wanted), group in groups.items():
        if len(group) < ALIKE or any(ctx.key_of(v) for v in group):
            continue
        count = (
            f"All {len(group)} tensors are"
            if len(group) == total
            else f"{len(group)} tensors ({examples([v.name for v in group])}) are"
        )
        ctx.problem(
            f"{count} {found} in {_say(ctx, 'stored')}; the skeleton is {wanted}: "
            f"{_say(ctx, 'cast')}.",
            kind="differs",
        )
    for (found, wanted), group in groups.items():
        if len(group) >= ALIKE and not any(ctx.key_of(v) for v in group):
            continue
        for v in group:
            key = ctx.key_of(v) is not None
            ctx.problem(
                f"Tensor `{v.name}`{ctx.of(v)} is {found} in {_say(ctx, 'stored')}, "
                f"but {_expects(ctx, wanted)}{_key(v, ctx)}.",
                FIX_KEY if key else sentence(_say(ctx, "cast")),
                kind="differs",
            )


def sentence(clause: str) -> str:
    return clause[:1].upper() + clause[1:] + "."


def report_missing(missing, virtuals, unexpected, given, ctx: Context) -> set[str]:
    """Missing tensors (a layer missing whole as one); each paired with an
    unexpected tensor of its shape where there is one. Returns the
    unexpected tensors so paired."""
    per_layer: dict[tuple, int] = {}
    for v in virtuals:
        if v.layers:
            per_layer[v.layers] = per_layer.get(v.layers, 0) + 1
    groups: dict[tuple, list[Virtual]] = {}
    for v in missing:
        groups.setdefault(v.layers, []).append(v)
    paired: set[str] = set()
    for layers, group in groups.items():
        if layers and len(group) > 1 and len(group) == per_layer[layers]:
            index = ", ".join(".".join(map(str, idx)) for _, idx in layers)
            ctx.problem(
                f"Layer {index} is missing from {_say(ctx, 'stored')}: none of its "
                f"{len(group)} tensors is there ({examples([v.name for v in group])}"
                f"; from {_leaves(group, ctx)}).",
                FIX_MISSING,
                kind="absent",
            )
            continue
        fix = (
            FIX_MISSING
            if ctx.mapped
            else FIX_MISSING_BY_NAME.format(rename=_say(ctx, "rename"))
        )
        for v in group:
            guess = _did_you_mean(v, unexpected, given, paired)
            ctx.problem(
                f"Tensor `{v.name}`{ctx.of(v)} is missing from "
                f"{_say(ctx, 'stored')}{guess}.",
                fix,
                kind="absent",
            )
    return paired


def _did_you_mean(v: Virtual, unexpected, given, paired: set[str]) -> str:
    name = closest(
        v.name,
        [n for n in unexpected if given[n].shape == v.shape],
        paired,
        lambda n: given[n].dtype == v.dtype,
    )
    if name is None:
        return ""
    return (
        f"; did you mean `{name}`, of that shape, which no leaf maps to? (rename "
        f"`{v.name}` to it)"
    )


def closest(name: str, alike: list[str], paired: set[str], best=None) -> str | None:
    """The unpaired name of `alike` closest to `name` (among those `best`
    accepts, if any), now paired: the "did you mean" of a missing leaf."""
    alike = [n for n in alike if n not in paired]
    if best is not None:
        alike = [n for n in alike if best(n)] or alike
    if len(alike) > _COMPARED:  # (difflib is quadratic in a name's length)
        alike = heapq.nlargest(_COMPARED, alike, key=lambda n: _ends_shared(name, n))
    close = difflib.get_close_matches(name, alike, n=1, cutoff=0.0)
    if close:
        paired.add(close[0])
    return close[0] if close else None


_COMPARED = 256  # the names most alike at their ends, compared in full
_LISTED = 1000  # unexpected tensors each a problem of its own; then one for the rest


def _ends_shared(a: str, b: str) -> int:
    """How many characters `a` and `b` share at their start and at their end."""
    return len(os.path.commonprefix([a, b])) + len(
        os.path.commonprefix([a[::-1], b[::-1]])
    )


def _leaves(group: list[Virtual], ctx: Context) -> str:
    names = list(dict.fromkeys(n for v in group for n in v.leaves))
    shown = some([ctx.labels.get(n, f"`{n}`") for n in names])
    return ("leaf " if len(names) == 1 else "leaves ") + shown


def report_unexpected(names, paired, mapping, virtuals, ctx: Context) -> None:
    if not names:
        return
    beyond = _beyond_stacks(names, mapping, virtuals)
    for (shown, count, index), group in beyond.items():
        ctx.problem(
            f"Layer {index} is in {_say(ctx, 'stored')} ({_count(len(group))}, "
            f"{examples(group)}), but the skeleton stacks {count} layers at "
            f"`{shown}` (0 to {count - 1}).",
            "Build the skeleton with the number of layers the tensors hold.",
            kind="unexpected",
        )
    listed = {n for group in beyond.values() for n in group}
    fix = FIX_UNEXPECTED.format(allow_unused=_say(ctx, "allow_unused"))
    left = [n for n in names if n not in listed and n not in paired]
    for name in left[:_LISTED]:
        ctx.problem(
            f"Tensor `{name}` is in {_say(ctx, 'stored')}, but no leaf maps to it.",
            fix,
            kind="unexpected",
        )
    if len(left) > _LISTED:
        ctx.problem(
            f"{_count(len(left) - _LISTED)} more are in {_say(ctx, 'stored')} that "
            f"no leaf maps to ({examples(left[_LISTED:])}).",
            fix,
            kind="unexpected",
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
        target = rule.templates[1]
        for name in names:
            m = target.prefix.fullmatch(name)
            if m is None:
                continue
            index = int(m.group(rule.new_holes[0]))
            if index >= count:
                out.setdefault((label(rule), count, index), []).append(name)
    return out


def planned(head: str, ctx: Context, kinds=None) -> str:
    """The message of the planner's problems (of `kinds`, if given): rules'
    own problems first, since the others are often their consequences."""
    problems = [p for p in ctx.problems if kinds is None or p.kind in kinds]
    problems.sort(key=lambda p: p.kind != "rule")
    fixes = list(dict.fromkeys(f for p in problems for f in p.fixes))
    if FIX_UNMATCHED in fixes:  # the other fixes are about the names they make
        fixes.remove(FIX_UNMATCHED)
        fixes.insert(0, FIX_UNMATCHED)
    if FIX_SIZES in fixes:  # what a split's sizes decide comes last
        fixes.remove(FIX_SIZES)
        fixes.append(FIX_SIZES)
    return message(head, problems, fixes)


def message(head: str, problems: Sequence[Problem], fixes: Sequence[str]) -> str:
    """`head (N problems):`, the problems as a list, then each fix once."""
    n = len(problems)
    return "\n".join(
        [
            f"{head} ({n} problem{'s' if n != 1 else ''}):",
            bullet_list([p.text for p in problems]),
            *dict.fromkeys(fixes),
        ]
    )


def _count(n: int) -> str:
    return f"{n} tensor{'s' if n != 1 else ''}"
