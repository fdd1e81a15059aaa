"""`rename_regex`: names rewritten by regular expressions.

`{"op": "rename_regex", "rules": [["layers\\\\.(\\\\d+)\\\\.(.*)", "h.\\\\1.\\\\2"]]}`:
the first pattern that matches a whole name gives its new name
(`re.Match.expand`); a new name of `null` leaves the name out. This is the
list form of the rename maps of `export --rename` and `import --rename`.
Patterns are checked before use (`safe_regex`).

Inverse: the names it made, read the other way (never a regex run backwards).
"""

import dataclasses
import re
from typing import Any

from ..errors import MappingError
from ..safe_regex import compile_safe
from ..stage import Context, Virtual
from . import schema
from .base import Rule, quote, unmatched


@dataclasses.dataclass(frozen=True)
class RenameRegex(Rule):
    op = "rename_regex"
    rules: tuple[tuple[str, str | None], ...]
    _compiled: list = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        compiled = []
        for pattern, replacement in self.rules:
            regex, why = compile_safe(pattern)
            if regex is None:
                raise MappingError(
                    f"The pattern {pattern!r} of a `rename_regex` rule {why}."
                )
            compiled.append(regex)
        object.__setattr__(self, "_compiled", compiled)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "rules": [list(r) for r in self.rules]}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RenameRegex":
        schema.keys(data, where, {"rules"})
        rules = []
        for i, rule in enumerate(schema.sequence(data["rules"], f'{where}: "rules"')):
            here = f'{where}: "rules"[{i}]'
            pair = schema.sequence(rule, here, limit=2)
            if len(pair) != 2:
                raise MappingError(
                    f'{here} must be a pair ["regex", "new name" or null].'
                )
            pattern = schema.string(pair[0], f"{here}[0]")
            new = None if pair[1] is None else schema.string(pair[1], f"{here}[1]")
            rules.append((pattern, new))
        return cls(tuple(rules))

    def label(self) -> str:
        pattern, new = self.rules[0] if self.rules else ("", None)
        more = ", ..." if len(self.rules) > 1 else ""
        shown = "None" if new is None else quote(new)
        return f".rename_regex([({quote(pattern)}, {shown}){more}])"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        compiled = self._compiled
        used = [False] * len(compiled)
        out = []
        for v in virtuals:
            for k, regex in enumerate(compiled):
                m = regex.fullmatch(v.name)
                if m is None:
                    continue
                used[k] = True
                replacement = self.rules[k][1]
                if replacement is None:
                    ctx.dropped.append(v)
                    break
                try:
                    new = m.expand(replacement)
                except (re.error, IndexError) as e:
                    ctx.problem(
                        f"{ctx.at_rule()} cannot rename `{v.name}` ({ctx.origin(v)}) "
                        f"with {replacement!r}: {e}.",
                        "Refer only to groups the pattern has (`\\1`, `\\g<name>`).",
                    )
                    out.append(v)
                    break
                if not new:
                    ctx.problem(
                        f"{ctx.at_rule()} renames `{v.name}` ({ctx.origin(v)}) to the "
                        "empty name.",
                        "Give every renamed name at least one part.",
                    )
                    break
                out.append(dataclasses.replace(v, name=new))
                break
            else:
                out.append(v)
        names = [v.name for v in virtuals]
        for k, ok in enumerate(used):
            if not ok:
                unmatched(ctx, f"The pattern {quote(self.rules[k][0])}", names)
        return out
