"""`renames=` of `EqxRestore`: a `StateDictMapping` from the skeleton's leaf
names to the checkpoint's, or a migration's dict `{old name: new name}`
(`mapping.from_old_names`). Renames alone go name by name (`_mapping.names`);
other rules are planned against the sidecar's leaves (`plan.plan_restore`).
"""

from collections.abc import Mapping
from typing import Any

from .._errors import bullet_list
from .._mapping.errors import MappingError, RenameError
from .._mapping.mapping import StateDictMapping, from_old_names
from .._mapping.rules.base import patterns, unmatched
from .._mapping.rules.drop import Drop, Ignore
from .._mapping.rules.rename import Rename
from .._mapping.rules.tie import Tie
from .._mapping.stage import Context, examples

Renames = StateDictMapping | Mapping[str, str | None]

_FIX_MATCH = (
    "Fix them (`python -m orbax_eqx inspect {where}` lists the checkpoint's leaf "
    "names), or pass `EqxRestore(..., renames_must_match=False)` to allow renames "
    "that do nothing."
)


def as_mapping(renames: Any) -> StateDictMapping | None:
    """`renames=` as a mapping; a `RenameError` if it is not one."""
    if renames is None:
        return None
    if isinstance(renames, StateDictMapping):
        mapping = renames
    elif isinstance(renames, Mapping):
        try:
            mapping = from_old_names(renames, "`renames=`")
        except MappingError as e:
            raise RenameError(str(e)) from None
    else:
        raise RenameError(
            f"`renames=` is a {type(renames).__name__}: expected an "
            "`oeqx.StateDictMapping` (regular expressions are its `rename_regex`: "
            '`StateDictMapping().rename_regex(r"layers\\.(.*)", r"blocks.\\1")` '
            "reads the skeleton's `layers.*` from the checkpoint's `blocks.*`), "
            "or a dict {old name: new name}."
        )
    refused = [
        r
        for r in mapping.rules
        if isinstance(r, Drop | Tie)
        or (isinstance(r, Rename) and None in r.names.values())
    ]
    if refused:
        raise RenameError(
            f"`renames=` has the rule {refused[0]!r:.200}, which a restore does not "
            "take: it reads every skeleton leaf. To keep skeleton leaves' own "
            'values, pass `missing="keep"`; to leave checkpoint leaves unread, '
            "`ignore` them (or map them to None in a dict)."
        )
    return mapping


def raise_rule_problems(ctx: Context, must_match: bool, where: str) -> None:
    """Raises `RenameError` for the rules' own problems: always for names made
    one, for entries that match nothing only if `must_match`."""
    problems = [p for p in ctx.problems if p.kind == "rule"]
    if not must_match:
        problems = [p for p in problems if "matches no name" not in p.text]
    if not problems:
        return
    fixes = list(dict.fromkeys(f for p in problems for f in p.fixes))
    raise RenameError(
        f"Some renames do nothing, or clash, for the checkpoint at {where}:\n"
        + bullet_list([p.text for p in problems])
        + "\n"
        + "\n".join([*fixes, _FIX_MATCH.format(where=where)])
    )


def unused_targets(mapping: StateDictMapping, pairs, saved_names, ctx) -> None:
    """Rule problems of what matches no checkpoint leaf: a rename whose every
    new name the checkpoint lacks (`pairs`: `(rule, entry) -> [(skeleton
    name, checkpoint name)]`), and an `ignore` pattern (a dict's `None`)."""
    for (rule, _), renamed in pairs.items():
        if any(stored in saved_names for _, stored in renamed):
            continue
        skeleton, stored = renamed[0]
        more = f" and {len(renamed) - 1} more" if len(renamed) > 1 else ""
        ctx.problem(
            f"Rule {rule} of `renames=` renames the skeleton's leaves "
            f"(`{skeleton}` -> `{stored}`{more}) only to names the checkpoint lacks "
            f"(its leaves are named like {examples(list(saved_names))}).",
        )
    for i, rule in enumerate(mapping.rules):
        if isinstance(rule, Ignore):
            ctx.at(i, rule)
            for pattern in patterns(rule.match):
                if not any(Ignore(pattern).ignores(n) for n in saved_names):
                    unmatched(ctx, f"The name {pattern!r}", list(saved_names))
