"""A mapping of renames applied to names alone: the fast path.

When every rule of a mapping only renames (`rename`, `rename_regex`) or
ignores, applying it needs no shapes and makes no pieces: each name goes
through the rules in order, one string at a time. A restore through such
a mapping costs what today's dict lookups cost, per leaf.
"""

from collections.abc import Sequence

from .mapping import StateDictMapping
from .rules.base import unmatched
from .rules.drop import Ignore
from .rules.rename import KEEP, Rename, report_unused
from .rules.rename_regex import RenameRegex
from .stage import Context


def through(
    mapping: StateDictMapping,
    names: Sequence[str],
    ctx: Context,
    trace: dict | None = None,
) -> list[str | None]:
    """Each of `names` through the mapping's renames, in order (None: left
    out). Entries that match nothing, shadowed entries, empty names and
    two names made one are problems in `ctx`. With `trace`, each `(rule,
    entry)` that renamed something gets the indices of the names it renamed."""
    current: list[str | None] = list(names)
    for i, rule in enumerate(mapping.rules):
        if not isinstance(rule, Rename | RenameRegex):
            continue  # `ignore` (the only other rule a names-only mapping has)
        ctx.at(i, rule)
        entries = len(rule.names) if isinstance(rule, Rename) else len(rule.rules)
        used = [False] * entries
        seen: set[int] = set()
        before = [n for n in current if n is not None]
        for k, name in enumerate(current):
            if name is None:
                continue
            if isinstance(rule, Rename):
                new, entry = rule.rename(name, seen)
            else:
                new, entry = rule.rename(name)
            if new is KEEP:
                continue
            used[entry] = True
            if trace is not None:
                trace.setdefault((i, entry), []).append(k)
            if new == "":
                ctx.problem(
                    f"{ctx.at_rule()} renames `{name}` to the empty name.",
                    "Give every renamed name at least one part.",
                )
                new = name
            current[k] = new
        if isinstance(rule, Rename):
            report_unused(rule, used, seen, before, ctx)
        else:
            for k, ok in enumerate(used):
                if not ok:
                    unmatched(ctx, f"The pattern {rule.rules[k][0]!r}", before)
    _unique(names, current, ctx)
    return current


def _unique(names: Sequence[str], current: list[str | None], ctx: Context) -> None:
    first: dict[str, str] = {}
    for old, new in zip(names, current, strict=True):
        if new is None:
            continue
        if new in first:
            ctx.problem(
                f"`{first[new]}` and `{old}` both become `{new}`.",
                "Give every name its own new name: a rename that makes one name "
                "twice needs another name for one of them.",
            )
        first.setdefault(new, old)


def ignores(mapping: StateDictMapping, name: str) -> bool:
    """Whether an `ignore` rule of the mapping leaves the stored `name` alone."""
    return any(isinstance(r, Ignore) and r.ignores(name) for r in mapping.rules)
