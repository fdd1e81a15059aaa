"""`renames=` of `EqxRestore`: checkpoint leaf names to skeleton leaf names.

Three forms, as a user writes them: a dict `{old name: new name}`; a list of
`(regex, replacement)` rules, of which the first whose pattern matches the
whole name gives the new name (`re.Match.expand`, as in the rename maps of
`export` and `import`); or a function `old name -> new name`. A new name of
`None` leaves the leaf out. Names map to names only: a restore never computes
on arrays.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import bullet_list, some
from .._format.sidecar import Metadata
from .._tree.walk import Walked
from .rename_map import RenameError

Renames = (
    Mapping[str, str | None]
    | Sequence[tuple[str | re.Pattern, str | None]]
    | Callable[[str], str | None]
)

# A name -> (new name or None, label of the entry that matched, or None).
_Rename = Callable[[str], tuple[str | None, str | None]]

_FIX_MATCH = (
    "Fix them (`python -m orbax_eqx inspect {where}` lists the checkpoint's leaf "
    "names), or pass `EqxRestore(..., renames_must_match=False)` to allow renames "
    "that do nothing."
)


def compile_renames(renames: Renames | None) -> tuple[_Rename, list[str]]:
    """The rename as one function, and the labels of its entries, in order."""
    if renames is None:
        return (lambda name: (name, None)), []
    if isinstance(renames, Mapping):
        return _by_name(renames)
    if callable(renames):
        return _by_function(renames)
    if isinstance(renames, Sequence) and not isinstance(renames, str):
        return _by_rules(renames)
    raise RenameError(
        f"`renames=` is a {type(renames).__name__}: expected a dict "
        "{old name: new name}, a list of (regex, replacement) rules, or a function "
        "old name -> new name."
    )


def _by_name(renames: Mapping) -> tuple[_Rename, list[str]]:
    bad = [k for k, v in renames.items() if not _is_name(k) or not _is_new(v)]
    if bad:
        raise RenameError(
            f"`renames=` maps {bad[0]!r} to {renames[bad[0]]!r}: a dict of "
            "renames maps checkpoint leaf names (str) to skeleton leaf names "
            "(str), or to None to leave a leaf out."
        )
    table = dict(renames)

    def by_name(name: str):
        if name in table:
            return table[name], _label_name(name, table[name])
        return name, None

    return by_name, [_label_name(k, v) for k, v in table.items()]


def _by_function(renames: Callable) -> tuple[_Rename, list[str]]:
    label = f"function {_describe(renames)}"

    def by_function(name: str):
        new = renames(name)
        if not _is_new(new):
            raise RenameError(
                f"The `renames=` {label} returned {new!r} for the "
                f"checkpoint leaf `{name}`: it must return a leaf name (str), "
                "or None to leave the leaf out."
            )
        return new, (label if new != name else None)

    return by_function, [label]


def _by_rules(renames: Sequence) -> tuple[_Rename, list[str]]:
    rules = [_rule(rule) for rule in renames]

    def by_rules(name: str):
        for regex, replacement, label in rules:
            match = regex.fullmatch(name)
            if match:
                try:
                    new = None if replacement is None else match.expand(replacement)
                except (re.error, IndexError) as e:
                    raise RenameError(
                        f"The `renames=` {label} cannot rename `{name}`: {e}."
                    ) from None
                return new, label
        return name, None

    return by_rules, [label for _, _, label in rules]


def _rule(rule: Any) -> tuple[re.Pattern, str | None, str]:
    """A `(regex, replacement)` rule checked and compiled, with its label."""
    if not (
        isinstance(rule, Sequence)
        and not isinstance(rule, str)
        and len(rule) == 2
        and isinstance(rule[0], str | re.Pattern)
        and _is_new(rule[1])
    ):
        raise RenameError(
            f"`renames=` holds the rule {rule!r}: a rule is a pair "
            '(regex, replacement), such as (r"blocks\\.(.*)", r"layers.\\1"); '
            "the replacement may be None to leave leaves out."
        )
    pattern, replacement = rule
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise RenameError(
            f"`renames=` has an invalid pattern {pattern!r} ({e})."
        ) from None
    return regex, replacement, f"rule ({regex.pattern!r}, {replacement!r})"


def _is_name(x: Any) -> bool:
    return isinstance(x, str)


def _is_new(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _label_name(old: str, new: str | None) -> str:
    return f"entry `{old}` -> " + ("None" if new is None else f"`{new}`")


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"`{name}`"


def check_unique(new_names: dict[str, str | None]) -> None:
    first: dict[str, str] = {}
    clashes = []
    for old, new in new_names.items():
        if new is None:
            continue
        if new in first:
            clashes.append(
                f"Checkpoint leaves `{first[new]}` and `{old}` both become `{new}`."
            )
        first.setdefault(new, old)
    if clashes:
        raise RenameError(
            "With `renames=`, checkpoint leaves would share a name:\n"
            + bullet_list(clashes)
            + "\nRename them to distinct names, or one of them to None to leave it "
            "out."
        )


def check_used(hits, wanted: set[str], saved: Metadata, walked: Walked) -> None:
    problems = []
    for label, matched in hits.items():
        if not matched:
            problems.append(
                f"The `renames=` {label} renames no checkpoint leaf."
                if label.startswith("function")
                else f"The `renames=` {label} matches no checkpoint leaf name "
                f"(they look like {examples(list(saved.leaves))})."
            )
        elif not any(new is None or new in wanted for _, new in matched):
            old, new = matched[0]
            shown = some([f"`{old}` -> `{new}`" for old, new in matched], 1)
            problems.append(
                f"The `renames=` {label} renames checkpoint leaves ({shown}) only "
                "to names the skeleton lacks (its leaves are "
                f"named like {examples([leaf.name for leaf in walked.leaves])})."
            )
    if problems:
        raise RenameError(
            f"Some renames do nothing for the checkpoint at {saved.directory}:\n"
            + bullet_list(problems)
            + "\n"
            + _FIX_MATCH.format(where=saved.directory)
        )


def examples(names: list[str], n: int = 3) -> str:
    text = ", ".join(f"`{name}`" for name in names[:n])
    return text + (", ..." if len(names) > n else "")
