"""`rename`: new names for leaves, or for whole subtrees of them.

`{"op": "rename", "names": {"embed": "wte", "blocks.{i}.attn": "h.{i}.attn"}}`
renames every name that is an entry or starts with an entry and a `.`
(`embed` renames `embed` and `embed.weight`, not `embedding`): the longest
entry that fits wins. Entries may have holes (`{i}`) that the new name
repeats; a new name of `null` leaves the names out (see `drop`), `""` the
parts that matched.

Inverse: the same names read the other way. A rename must stay one-to-one;
the planner reports names that two leaves would share.
"""

import functools
from typing import Annotated

import msgspec

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual
from .base import MAX_PARTS, Rule, Text, template, unmatched

NewName = Annotated[str, msgspec.Meta(max_length=templates.MAX_LENGTH)] | None
Names = Annotated[dict[Text, NewName], msgspec.Meta(max_length=MAX_PARTS * 16)]

KEEP = object()  # what `Rename.rename` gives a name no entry fits


class Rename(Rule, frozen=True, tag="rename"):
    names: Names

    def __post_init__(self):
        _parsed(tuple(self.names.items()))

    def rename(self, name: str, seen: set[int] | None = None):
        """`(new name or None, entry)` of `name`, or `(KEEP, None)`. Entries that
        fit `name` but lose to a longer one are added to `seen`."""
        literal, holed, parsed = _parsed(tuple(self.names.items()))
        found = _longest(name, literal, holed, parsed, seen)
        if found is None:
            return KEEP, None
        k, binding, rest = found
        target = parsed[k][1]
        if target is None:
            return None, k
        new = target.render(binding)
        if rest is not None:
            new = f"{new}.{rest}" if new else rest
        return new, k

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        used = [False] * len(self.names)
        seen: set[int] = set()
        out = []
        for v in virtuals:
            new, k = self.rename(v.name, seen)
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
        report_unused(self, used, seen, [v.name for v in virtuals], ctx)
        return out


def report_unused(rule: Rename, used, seen, names, ctx: Context) -> None:
    """Entries that renamed nothing: shadowed by longer ones, or matching no name."""
    entries = list(rule.names)
    for k, ok in enumerate(used):
        if ok:
            continue
        if k in seen:
            ctx.problem(
                f"The entry {entries[k]!r} of {ctx.at_rule()} is shadowed: every "
                "name it fits is renamed by a longer entry.",
                "Remove shadowed entries, or make the longer entries say what "
                "they should.",
            )
        else:
            unmatched(ctx, f"The entry {entries[k]!r}", names)


@functools.lru_cache(maxsize=256)
def _parsed(names: tuple):
    """The entries as templates: `(literal entries, holed entries, parsed)`."""
    parsed = []
    for old, new in names:
        where = f"the entry {old!r} of a `rename` rule"
        source = template(old, where, wildcards=False)
        target = None
        if new == "":  # the part is left out: `a.b` -> `b`
            target = templates.Template("", ())
        elif new is not None:
            target = template(new, f"{where} (its new name)", wildcards=False)
            extra = set(target.holes) - set(source.holes)
            if extra:
                raise MappingError(
                    f"{where} gives the new name {new!r} the hole "
                    f"`{{{sorted(extra)[0]}}}`, which the entry lacks: a new name "
                    "may only repeat the entry's holes."
                )
        parsed.append((source, target))
    literal: dict[str, int] = {}
    holed = []
    for k, (source, _) in enumerate(parsed):
        if source.literal is None:
            holed.append(k)
        else:
            literal.setdefault(source.literal, k)
    return literal, holed, parsed


def _longest(name, literal, holed, parsed, seen):
    """(entry, binding, rest of the name or None) of the longest entry that is
    the name or its leading parts."""
    best = None
    end = len(name)
    while end > 0:  # the name itself, then each prefix ending before a `.`
        k = literal.get(name[:end])
        if k is not None:
            if best is None:
                best = (end, k, {}, name[end + 1 :] if end < len(name) else None)
                if seen is None:
                    break
            else:
                seen.add(k)
        end = name.rfind(".", 0, end)
    for k in holed:
        source = parsed[k][0]
        m = source.prefix.fullmatch(name)
        if m is None:
            continue
        rest = m.group("_rest")
        length = len(name) - (len(rest) + 1 if rest is not None else 0)
        if best is None or length > best[0]:
            if best is not None and seen is not None:
                seen.add(best[1])
            best = (length, k, templates.binding(m, source.holes), rest)
        elif seen is not None:
            seen.add(k)
    return None if best is None else best[1:]
