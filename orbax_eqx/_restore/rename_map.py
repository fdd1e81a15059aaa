"""Rename maps for `export` and `import`: a JSON file that renames tensors.

Two forms:

- an object of exact names, `{"layers.0.weight": "net.0.weight", ...}`;
- a list of rules, `[["layers\\.(\\d+)\\.(.*)", "net.\\1.\\2"], ...]`: the first
  rule whose pattern matches the whole name gives the new name
  (`re.Match.expand`).

A new name of `null` leaves the tensor out. Names no entry or rule matches
keep their name. An entry or rule that matches nothing is an error, since it
is almost always a typo.
"""

import dataclasses
import json
import os
import re
from collections.abc import Callable

from etils import epath

from .._bytes import files as _files
from .._bytes.paths import is_remote
from .._errors import OrbaxEqxError, inline_list


class RenameError(OrbaxEqxError, ValueError):
    """A rename map is unreadable, matches nothing, or makes two names one."""


@dataclasses.dataclass(frozen=True)
class RenameMap:
    """A loaded rename map; call `apply` on the full list of names."""

    source: str
    rename: Callable[[str], tuple[str | None, str | None]]  # -> (new, rule used)
    rules: list[str]

    def apply(self, names: list[str]) -> dict[str, str | None]:
        """`{old: new}` for every name (`None`: left out); checks the result."""
        result, used = {}, set()
        for name in names:
            result[name], rule = self.rename(name)
            used.add(rule)
        unused = [r for r in self.rules if r not in used]
        if unused:
            raise RenameError(
                f"The rename map {self.source} has entries that match no tensor "
                f"name: {inline_list(unused)}. Fix or remove them (`inspect` shows "
                "the names)."
            )
        check_unique(result, f"the rename map {self.source}")
        return result


# Far more than any rename map: thousands of rules are a few hundred KiB.
_MAX_BYTES = 64 << 20


def identity() -> RenameMap:
    return RenameMap("(none)", lambda name: (name, None), [])


def load(path: str | os.PathLike | None) -> RenameMap:
    """Reads the rename map in the JSON file at `path`; `None` renames nothing."""
    if path is None:
        return identity()
    source = os.fspath(path)

    def refused(what: str) -> RenameError:
        return RenameError(
            f"The rename map {source} {what}. Pass the path of the JSON file of "
            "renames."
        )

    # Bounded and never blocking: a FIFO or `/dev/zero` given by mistake.
    where = epath.Path(source) if is_remote(source) else source
    try:
        data = _files.read_bounded(where, _MAX_BYTES, refused)
    except FileNotFoundError:
        raise refused("does not exist") from None
    try:
        content = json.loads(data.decode("utf-8"))
    except ValueError as e:  # also bytes that are not UTF-8
        raise RenameError(f"The rename map {source} is not valid JSON ({e}).") from None
    if isinstance(content, dict) and all(
        isinstance(v, str | None) for v in content.values()
    ):
        return RenameMap(
            source,
            lambda name: (
                (content[name], repr(name)) if name in content else (name, None)
            ),
            [repr(k) for k in content],
        )
    if isinstance(content, list) and all(_is_rule(r) for r in content):
        return _rules(source, content)
    raise RenameError(
        f"The rename map {source} must be a JSON object of names "
        '({"old": "new" or null}) or a list of rules ([["regex", "new" or null]]).'
    )


def _is_rule(rule) -> bool:
    return (
        isinstance(rule, list)
        and len(rule) == 2
        and isinstance(rule[0], str)
        and isinstance(rule[1], str | None)
    )


def _rules(source: str, content: list) -> RenameMap:
    compiled = []
    for pattern, replacement in content:
        try:
            compiled.append((re.compile(pattern), replacement, repr(pattern)))
        except re.error as e:
            raise RenameError(
                f"The rename map {source} has an invalid pattern {pattern!r} ({e})."
            ) from None

    def rename(name: str):
        for regex, replacement, label in compiled:
            match = regex.fullmatch(name)
            if match:
                return (
                    None if replacement is None else match.expand(replacement)
                ), label
        return name, None

    return RenameMap(source, rename, [label for _, _, label in compiled])


def check_unique(renamed: dict[str, str | None], where: str) -> None:
    """Raises `RenameError` if two names map to one."""
    first: dict[str, str] = {}
    clashes = []
    for old, new in renamed.items():
        if new is None:
            continue
        if new in first:
            clashes.append(f"`{first[new]}` and `{old}` both become `{new}`")
        first.setdefault(new, old)
    if clashes:
        raise RenameError(
            f"With {where}, tensors would share a name: {inline_list(clashes)}. "
            "Give them distinct names."
        )
