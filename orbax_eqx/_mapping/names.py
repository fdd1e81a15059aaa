"""A mapping's renames applied to names alone, one string per name (no shapes,
no pieces): a restore's `renames=` and the command line's `--rename` maps."""

import dataclasses
import os
from collections.abc import Sequence

from .._errors import inline_list
from .errors import MappingError, RenameError
from .mapping import StateDictMapping
from .rules.drop import Ignore
from .rules.rename import KEEP, Renaming, rename_all
from .stage import Context


def through(
    mapping: StateDictMapping,
    names: Sequence[str],
    ctx: Context,
    trace: dict | None = None,
) -> list[str | None]:
    """Each of `names` through the mapping's renames, in order (None: left
    out); the rules' problems and two names made one are problems in `ctx`.
    With `trace`, each `(rule, entry)` that renamed something gets the
    indices of the names it renamed."""
    current: list[str | None] = list(names)
    for i, rule in enumerate(mapping.rules):
        if not isinstance(rule, Renaming):
            continue  # `ignore` (the only other rule a names-only mapping has)
        ctx.at(i, rule)
        for k, (new, entry) in enumerate(rename_all(rule, current, ctx)):
            if new is not KEEP:
                if trace is not None:
                    trace.setdefault((i, entry), []).append(k)
                current[k] = new
    first: dict[str, str] = {}
    for old, new in zip(names, current, strict=True):
        if new is not None and first.setdefault(new, old) != old:
            ctx.problem(
                f"`{first[new]}` and `{old}` both become `{new}`.",
                "Give every name its own new name: a rename that makes one name "
                "twice needs another name for one of them.",
            )
    return current


def ignores(mapping: StateDictMapping, name: str) -> bool:
    """Whether an `ignore` rule of the mapping leaves the stored `name` alone."""
    return any(isinstance(r, Ignore) and r.ignores(name) for r in mapping.rules)


@dataclasses.dataclass(frozen=True)
class RenameMap:
    """A `--rename` file: a mapping of renames only, applied to all names."""

    source: str
    mapping: StateDictMapping

    def apply(self, names: list[str]) -> dict[str, str | None]:
        """`{old: new}` for every name (`None`: left out); checks the result."""
        ctx = Context({})
        new = through(self.mapping, names, ctx)
        if ctx.problems:
            found = [p.text.removesuffix(".") for p in ctx.problems]
            raise RenameError(
                f"The rename map {self.source} does not fit the names: "
                f"{inline_list(found)}. Fix or remove those entries (`inspect` "
                "shows the names)."
            )
        return dict(zip(names, new, strict=True))


def load(path: str | os.PathLike | None) -> RenameMap:
    """The rename map in the JSON file at `path`; `None` renames nothing."""
    if path is None:
        return RenameMap("(none)", StateDictMapping())
    source = os.fspath(path)
    try:
        mapping = StateDictMapping.from_file(source)
    except MappingError as e:  # a `--rename` file's problem is a rename's
        raise RenameError(str(e)) from None
    if not mapping.names_only:
        raise RenameError(
            f"The rename map {source} has rules that change arrays; give it as a "
            "mapping (--mapping) instead."
        )
    return RenameMap(source, mapping)
