"""Rename maps of the command line (`--rename`), applied to names alone.

A rename map is a mapping file (`StateDictMapping.from_file`: the full form,
or its shorthands, an object of names or a list of `[regex, new name]`
pairs) whose rules only rename. `RenameMap.apply` runs them over a list of
names (`_mapping.names.through`: the mapping's own rules, RE2 for the
patterns) for the `renames=` of the bridge's `load` and `export`.
"""

import dataclasses
import os

from .._errors import inline_list
from .._mapping.errors import MappingError
from .._mapping.errors import RenameError as RenameError
from .._mapping.mapping import StateDictMapping
from .._mapping.names import through
from .._mapping.stage import Context
from .._mapping.wording import CLI


@dataclasses.dataclass(frozen=True)
class RenameMap:
    """A loaded rename map; call `apply` on the full list of names."""

    source: str
    mapping: StateDictMapping

    def apply(self, names: list[str]) -> dict[str, str | None]:
        """`{old: new}` for every name (`None`: left out); checks the result."""
        ctx = Context({}, CLI)
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
    """Reads the rename map in the JSON file at `path`; `None` renames nothing."""
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
