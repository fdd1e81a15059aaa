"""`rename`: new names for leaves, or for whole subtrees of them.

`{"op": "rename", "names": {"embed": "wte", "blocks.{i}.attn": "h.{i}.attn"}}`
renames every name that is an entry or starts with an entry and a `.`
(`embed` renames `embed` and `embed.weight`, not `embedding`): the longest
entry that fits wins. Entries may have holes (`{i}`) that the new name
repeats; a new name of `null` leaves the names out (see `drop`).

Inverse: the same names read the other way. A rename must stay one-to-one;
the planner reports names that two leaves would share.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual
from . import schema
from .base import Rule, quote, unmatched


@dataclasses.dataclass(frozen=True)
class Rename(Rule):
    op = "rename"
    names: tuple[tuple[str, str | None], ...]
    _parsed: list = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        parsed = []
        for old, new in self.names:
            where = f"the entry {old!r} of a `rename` rule"
            source = schema.template(old, where, wildcards=False)
            target = None
            if new == "":  # the part is left out: `a.b` -> `b`
                target = templates.Template("", ())
            elif new is not None:
                target = schema.template(
                    new, f"{where} (its new name)", wildcards=False
                )
                extra = set(target.holes) - set(source.holes)
                if extra:
                    raise MappingError(
                        f"{where} gives the new name {new!r} the hole "
                        f"`{{{sorted(extra)[0]}}}`, which the entry lacks: a new name "
                        "may only repeat the entry's holes."
                    )
            parsed.append((source, target))
        object.__setattr__(self, "_parsed", parsed)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "names": dict(self.names)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Rename":
        schema.keys(data, where, {"names"})
        names = data["names"]
        if not isinstance(names, Mapping):
            raise MappingError(
                f'{where}: "names" must be an object of names {{"old": "new" or '
                f"null}}, not {schema._kind(names)}."
            )
        if len(names) > schema.MAX_PARTS * 16:
            raise MappingError(f'{where}: "names" has {len(names)} entries, too many.')
        entries = []
        for old, new in names.items():
            schema.string(old, f'{where}, an entry of "names"')
            if new is not None:
                schema.string(new, f'{where}, the new name of "{old}"')
            entries.append((old, new))
        return cls(tuple(entries))

    def label(self) -> str:
        if len(self.names) == 1:
            old, new = self.names[0]
            return f".rename({quote(old)}, {_new(new)})"
        inner = ", ".join(f"{quote(o)}: {_new(n)}" for o, n in self.names[:2])
        more = ", ..." if len(self.names) > 2 else ""
        return f".rename({{{inner}{more}}})"

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        parsed = self._parsed
        literal: dict[str, int] = {}
        holed = []
        for k, (source, _) in enumerate(parsed):
            text = source.literal
            if text is None:
                holed.append(k)
            else:
                literal.setdefault(text, k)
        used = [False] * len(parsed)
        out = []
        for v in virtuals:
            found = _longest(v.name, literal, holed, parsed)
            if found is None:
                out.append(v)
                continue
            k, binding, rest = found
            used[k] = True
            target = parsed[k][1]
            if target is None:
                ctx.dropped.append(v)
                continue
            new = target.render(binding)
            if rest is not None:
                new = f"{new}.{rest}" if new else rest
            if not new:
                ctx.problem(
                    f"{ctx.at_rule()} renames `{v.name}` ({ctx.origin(v)}) to the "
                    "empty name.",
                    "Give every renamed name at least one part.",
                )
                continue
            out.append(dataclasses.replace(v, name=new))
        names = [v.name for v in virtuals]
        for k, ok in enumerate(used):
            if not ok:
                unmatched(ctx, f"The entry {quote(self.names[k][0])}", names)
        return out


def _longest(name, literal, holed, parsed):
    """(entry, binding, rest of the name or None) of the longest entry that is
    the name or its leading parts."""
    best = None
    end = len(name)
    while end > 0:  # the name itself, then each prefix ending before a `.`
        k = literal.get(name[:end])
        if k is not None:
            best = (end, k, {}, name[end + 1 :] if end < len(name) else None)
            break
        end = name.rfind(".", 0, end)
    for k in holed:
        source = parsed[k][0]
        m = source.prefix.fullmatch(name)
        if m is None:
            continue
        rest = m.group("_rest")
        length = len(name) - (len(rest) + 1 if rest is not None else 0)
        if best is None or length > best[0]:
            best = (length, k, templates.binding(m, source.holes), rest)
    return None if best is None else best[1:]


def _new(new: str | None) -> str:
    return "None" if new is None else quote(new)
