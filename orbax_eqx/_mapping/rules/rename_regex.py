r"""`rename_regex`: the first RE2 pattern that matches a whole name gives its
new name (`{"op": "rename_regex", "rules": [["layers\\.(\\d+)", "h.\\1"]]}`;
`null` leaves it out). Inverse: the names it made, read the other way."""

import functools
from typing import Annotated

import msgspec

from .. import regex
from .base import MAX_PARTS
from .rename import KEEP, Renaming

Pattern = Annotated[str, msgspec.Meta(max_length=regex.MAX_LENGTH)]
Pair = tuple[Pattern, Pattern | None]


class RenameRegex(Renaming, frozen=True, tag="rename_regex"):
    rules: Annotated[list[Pair], msgspec.Meta(max_length=MAX_PARTS)]

    def __post_init__(self):
        _compiled(tuple(self.rules))

    def entries(self) -> list[str]:
        return [pattern for pattern, _ in self.rules]

    def rename(self, name: str, seen: set[int]) -> tuple[object, int | None]:
        for k, (pattern, pieces) in enumerate(_compiled(tuple(self.rules))):
            m = pattern.fullmatch(name)
            if m is not None:
                return (None if pieces is None else regex.expand(m, pieces)), k
        return KEEP, None


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
