"""What every rule is: a msgspec struct (its JSON checked against the bounds
below) whose `apply` turns the tensors made so far (`stage.Virtual`) into the
next ones, from the leaves towards the tensors. Loads never run a rule
backwards: they read the same pieces the other way (`pieces.to_leaf`)."""

import functools
import re
from collections.abc import Callable
from typing import Annotated

import msgspec

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual, examples

MAX_RANK = 64  # axes of a tensor, entries of a permutation
MAX_PARTS = 4096  # tensors a split makes or a fuse takes, names a rule lists
MAX_SIZE = 2**62  # a size along an axis

Text = Annotated[str, msgspec.Meta(min_length=1, max_length=templates.MAX_LENGTH)]
Texts = Annotated[list[Text], msgspec.Meta(min_length=1, max_length=MAX_PARTS)]
Match = Text | Texts  # a template, or a list of them
Axis = Annotated[int, msgspec.Meta(ge=-MAX_RANK, le=MAX_RANK - 1)]
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_SIZE)]


class Rule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    """One transformation of a mapping; each kind is tagged by its `"op"`."""

    def __post_init__(self):
        if isinstance(getattr(self, "match", None), str | list):
            self.selected()  # a template that breaks the grammar: refused here

    def selected(self) -> tuple[templates.Template, ...]:
        """The templates of the rule's `"match"` (wildcards allowed)."""
        match = getattr(self, "match")
        where = f'The `{self.__struct_config__.tag}` rule: "match"'
        return selector((match,) if isinstance(match, str) else tuple(match), where)

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        raise NotImplementedError


def patterns(match: str | list[str]) -> tuple[str, ...]:
    return (match,) if isinstance(match, str) else tuple(match)


def template(text: str, where: str, *, wildcards: bool) -> templates.Template:
    """`text` parsed as a template; a `MappingError` naming `where` if it is not."""
    try:
        return templates.parse(text, wildcards=wildcards, what=where)
    except templates.TemplateError as e:
        raise MappingError(f"{e}.") from None


@functools.lru_cache(maxsize=1024)
def selector(match: tuple[str, ...], where: str) -> tuple[templates.Template, ...]:
    """The templates of a rule's `"match"` (wildcards allowed)."""
    return tuple(
        template(p, f"{where}[{i}]" if len(match) > 1 else where, wildcards=True)
        for i, p in enumerate(match)
    )


def first_match(
    selected: tuple[templates.Template, ...], name: str
) -> tuple[int, re.Match] | None:
    """The first template that matches all of `name`, and its match."""
    for i, t in enumerate(selected):
        m = t.whole.fullmatch(name)
        if m is not None:
            return i, m
    return None


def each_matched(
    rule: Rule,
    virtuals: list[Virtual],
    ctx: Context,
    change: Callable[[Virtual], list[Virtual]],
) -> list[Virtual]:
    """The tensors after `rule` puts `change(v)` (nothing, itself, or a changed
    one) in place of each one its `"match"` selects; a pattern that matches
    nothing is a problem (`unmatched`)."""
    chosen = patterns(getattr(rule, "match"))
    selected = rule.selected()
    used = [False] * len(chosen)
    out = []
    for v in virtuals:
        found = first_match(selected, v.name)
        if found is None:
            out.append(v)
            continue
        used[found[0]] = True
        out.extend(change(v))
    names = [v.name for v in virtuals]
    for k, ok in enumerate(used):
        if not ok:
            unmatched(ctx, f"The pattern {chosen[k]!r}", names)
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
