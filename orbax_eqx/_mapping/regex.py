r"""Users' regular expressions (`rename_regex`, `renames=`, `--rename`), matched by
RE2 in time linear in the name: Python's syntax without backreferences,
lookarounds or atomic groups; `\d`, `\w`, `\s` match ASCII. Replacements
take `\1`...`\99`, `\g<name>` and `\\` (an unmatched group inserts nothing)."""

import functools
import re as _re

import re2

from .errors import MappingError

MAX_LENGTH = 1024  # characters of a pattern or a replacement

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # errors are ours to word, not RE2's to print
_REFERENCE = _re.compile(r"\\(?:([1-9][0-9]?)|g<([^>]*)>|(\\)|(.?))", _re.DOTALL)


def compile(pattern: str, where: str):
    """`pattern` compiled by RE2; a `MappingError` saying why, naming `where`."""
    try:
        return _compiled(pattern)
    except re2.error as e:
        why = e.args[0] if e.args else e
        why = why.decode(errors="replace") if isinstance(why, bytes) else str(why)
        raise MappingError(
            f"{where}: the pattern {pattern[:200]!r} is not one RE2 takes ({why}). "
            "Patterns are matched in linear time: no backreferences or lookarounds."
        ) from None


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str):
    return re2.compile(pattern, _OPTIONS)


def template(regex, replacement: str, where: str) -> tuple:
    """`replacement` as literal texts and `(group,)` references, checked
    against the groups `regex` has."""
    pieces: list = []
    at = 0
    for m in _REFERENCE.finditer(replacement):
        pieces.append(replacement[at : m.start()])
        at = m.end()
        number, name, backslash, other = m.groups()
        if backslash:
            pieces.append("\\")
            continue
        if other is not None:
            raise MappingError(
                f"{where}: the replacement {replacement[:200]!r} has the escape "
                f"`\\{other}`; a replacement takes `\\1`, `\\g<name>` and `\\\\`."
            )
        group: int | str = int(number) if number else name
        if isinstance(group, str) and group.isdigit():
            group = int(group)
        known = (
            group <= regex.groups
            if isinstance(group, int)
            else group in regex.groupindex
        )
        if not known:
            raise MappingError(
                f"{where}: the replacement {replacement[:200]!r} refers to the group "
                f"{group!r}, which the pattern {regex.pattern[:200]!r} lacks."
            )
        pieces.append((group,))
    pieces.append(replacement[at:])
    return tuple(pieces)


def expand(match, pieces: tuple) -> str:
    """The new name: `pieces` (from `template`) with `match`'s groups in."""
    return "".join(
        p if isinstance(p, str) else (match.group(p[0]) or "") for p in pieces
    )
