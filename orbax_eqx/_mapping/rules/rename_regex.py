r"""`rename_regex`: names rewritten by regular expressions.

`{"op": "rename_regex", "rules": [["layers\\.(\\d+)\\.(.*)", "h.\\1.\\2"]]}`:
the first pattern that matches a whole name gives its new name (`\1` is the
first group, `\g<name>` a named one); a new name of `null` leaves the name
out. Patterns are RE2's, matched in linear time (`regex`). This is also the
list form of a `--rename` file.

Inverse: the names it made, read the other way (never a regex run backwards).
"""

import functools
from typing import Annotated

import msgspec

from .. import regex
from ..stage import Context, Virtual
from .base import MAX_PARTS, Rule, unmatched
from .rename import KEEP

Pattern = Annotated[str, msgspec.Meta(max_length=regex.MAX_LENGTH)]
Pair = tuple[Pattern, Pattern | None]


class RenameRegex(Rule, frozen=True, tag="rename_regex"):
    rules: Annotated[list[Pair], msgspec.Meta(max_length=MAX_PARTS)]

    def __post_init__(self):
        _compiled(tuple(self.rules))

    def rename(self, name: str):
        """`(new name or None, rule)` of `name`, or `(KEEP, None)`."""
        for k, (pattern, pieces) in enumerate(_compiled(tuple(self.rules))):
            m = pattern.fullmatch(name)
            if m is not None:
                return (None if pieces is None else regex.expand(m, pieces)), k
        return KEEP, None

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        used = [False] * len(self.rules)
        out = []
        for v in virtuals:
            new, k = self.rename(v.name)
            if new is KEEP:
                out.append(v)
                continue
            used[k] = True
            if new is None:
                ctx.dropped.append(v)
            elif not new:
                ctx.problem(
                    f"{ctx.at_rule()} renames `{v.name}` ({ctx.origin(v)}) to the "
                    "empty name.",
                    "Give every renamed name at least one part.",
                )
            else:
                out.append(v.but(name=new))
        names = [v.name for v in virtuals]
        for k, ok in enumerate(used):
            if not ok:
                unmatched(ctx, f"The pattern {self.rules[k][0]!r}", names)
        return out


@functools.lru_cache(maxsize=256)
def _compiled(rules: tuple) -> list:
    out = []
    for i, (pattern, new) in enumerate(rules):
        where = f"Rule {i} of a `rename_regex`"
        compiled = regex.compile(pattern, where)
        out.append(
            (compiled, None if new is None else regex.template(compiled, new, where))
        )
    return out
