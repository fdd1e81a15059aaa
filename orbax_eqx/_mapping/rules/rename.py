"""`rename`: new names for leaves, or whole subtrees of them (`{"op": "rename",
"names": {"embed": "wte", "blocks.{i}.attn": "h.{i}.attn"}}`: the longest
entry that is a name or its leading parts wins; `null` leaves names out, `""`
the parts that matched). Inverse: the same names read the other way."""

import functools
from typing import Annotated

import msgspec

from .. import templates
from ..errors import MappingError
from ..stage import Context, Virtual
from .base import MAX_PARTS, Rule, Text, template, unmatched

NewName = Annotated[str, msgspec.Meta(max_length=templates.MAX_LENGTH)] | None
Names = Annotated[dict[Text, NewName], msgspec.Meta(max_length=MAX_PARTS * 16)]

KEEP = object()  # the new name of a name no entry fits


class Renaming(Rule, frozen=True):
    """A rule that only renames (`rename`, `rename_regex`): each name alone."""

    def rename(self, name: str, seen: set[int]) -> tuple[object, int | None]:
        """`(new name or None, entry)` of `name`, or `(KEEP, None)`; entries
        that fit but lose to a longer one are added to `seen`."""
        raise NotImplementedError

    def entries(self) -> list[str]:
        raise NotImplementedError

    def apply(self, virtuals: list[Virtual], ctx: Context) -> list[Virtual]:
        out = []
        new = rename_all(self, [v.name for v in virtuals], ctx)
        for v, (name, _) in zip(virtuals, new, strict=True):
            if name is None:
                ctx.dropped.append(v)
            else:
                out.append(v if name is KEEP else v.but(name=name))
        return out


def rename_all(rule: Renaming, names: list, ctx: Context) -> list[tuple]:
    """`(new, entry)` for each of `names` (None: no name) through `rule`: new
    is the new name, None (left out) or KEEP. Entries that rename nothing
    (shadowed, or matching no name) and empty new names are problems."""
    entries = rule.entries()
    used = [False] * len(entries)
    seen: set[int] = set()
    out: list[tuple] = []
    for name in names:
        new, k = (KEEP, None) if name is None else rule.rename(name, seen)
        if k is not None:
            used[k] = True
        if new == "":
            ctx.problem(
                f"{ctx.at_rule()} renames `{name}` to the empty name.",
                "Give every renamed name at least one part.",
            )
            new = KEEP
        out.append((new, k))
    what = "entry" if isinstance(rule, Rename) else "pattern"
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
            named = [n for n in names if n is not None]
            unmatched(ctx, f"The {what} {entries[k]!r}", named)
    return out


class Rename(Renaming, frozen=True, tag="rename"):
    names: Names

    def __post_init__(self):
        _parsed(tuple(self.names.items()))

    def entries(self) -> list[str]:
        return list(self.names)

    def rename(self, name: str, seen: set[int]) -> tuple[object, int | None]:
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
