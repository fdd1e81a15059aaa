"""What every rule of a mapping is: JSON in, JSON out, and one step of the plan.

A rule acts in the direction leaves -> tensors (the way `to_state_dict`
goes): `apply` turns the virtual tensors made so far (`stage.Virtual`) into
the next ones. Loading never runs a rule backwards: the planner makes the
tensors a skeleton's leaves would become, compares them with the tensors it
is given, and reads each piece the other way (`pieces.to_leaf`), so every
rule's inverse is derived from the same pieces.
"""

import re
from collections.abc import Callable
from typing import Any, ClassVar

from ..stage import Context, Virtual, examples
from . import schema


class Rule:
    """One transformation of a mapping."""

    op: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Rule":
        raise NotImplementedError

    def label(self) -> str:
        """The rule as the builder call that makes it: `.stack("blocks", "h.{i}")`."""
        raise NotImplementedError

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        raise NotImplementedError


class Selector:
    """Names chosen by a list of templates (wildcards allowed): the first that
    matches a whole name wins."""

    def __init__(self, patterns: tuple[str, ...], where: str):
        self.patterns = patterns
        self.templates = [
            schema.template(
                p, f"{where}[{i}]" if len(patterns) > 1 else where, wildcards=True
            )
            for i, p in enumerate(patterns)
        ]

    def match(self, name: str) -> tuple[int, re.Match] | None:
        for i, t in enumerate(self.templates):
            m = t.whole.fullmatch(name)
            if m is not None:
                return i, m
        return None

    def json(self) -> str | list[str]:
        return self.patterns[0] if len(self.patterns) == 1 else list(self.patterns)

    def shown(self) -> str:
        if len(self.patterns) == 1:
            return quote(self.patterns[0])
        return "[" + ", ".join(quote(p) for p in self.patterns) + "]"


def each_matched(
    selector: "Selector",
    virtuals: list[Virtual],
    ctx: Context,
    change: Callable[[Virtual], list[Virtual]],
) -> list[Virtual]:
    """The tensors after a rule that changes each one `selector` matches:
    `change(v)` says what stands in its place (nothing, itself, or a changed
    one); the others stay as they are. A pattern that matches nothing is a
    problem (`unmatched`)."""
    used = [False] * len(selector.patterns)
    out = []
    for v in virtuals:
        found = selector.match(v.name)
        if found is None:
            out.append(v)
            continue
        used[found[0]] = True
        out.extend(change(v))
    names = [v.name for v in virtuals]
    for k, ok in enumerate(used):
        if not ok:
            unmatched(ctx, f"The pattern {quote(selector.patterns[k])}", names)
    return out


def unmatched(ctx: Context, what: str, names: list[str]) -> None:
    """A rule (or an entry of one) that matched no name: almost always a typo."""
    ctx.problem(
        f"{what} of {ctx.at_rule()} matches no name (the names it sees look like "
        f"{examples(names)}).",
        FIX_UNMATCHED,
    )


FIX_UNMATCHED = (
    "Fix the rules that match nothing: each rule sees the names that the rules "
    "before it made, and matches them whole."
)


def quote(text: str) -> str:
    """`text` as a Python string literal, for labels."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
