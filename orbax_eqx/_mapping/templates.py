"""Name templates: `{i}` (a lowercase name) for a layer index (`0`, `11`, never
`07`), `*` for text within one part of a name and `**` for any text (only
where a rule selects tensors), `{{`, `}}` and `{*}` for literal `{`, `}`, `*`.

Templates and names may come from anyone's files: a hole matches at most 18
digits between text that is not digits, holes and wildcards are separated by
text, and at most two wildcards: matching a `MAX_NAME` name takes
milliseconds at worst."""

import dataclasses
import functools
import itertools
import re

MAX_LENGTH = 1024  # characters of a template or of a name a rule writes
MAX_HOLES = 8  # `{i}` per template
MAX_WILDCARDS = 2  # `*` or `**` per template
MAX_NAME = 2048  # characters of a name a template is matched against

INDEX = "0|[1-9][0-9]{0,17}"
_HOLE = re.compile(r"[a-z][a-z0-9_]*")


class TemplateError(ValueError):
    """A template that breaks the grammar above; the message says where."""


@dataclasses.dataclass(frozen=True)
class Template:
    text: str
    # ("text", literal) | ("hole", name) | ("glob", "*" or "**"), in order
    tokens: tuple[tuple[str, str], ...]

    @property
    def holes(self) -> tuple[str, ...]:
        return tuple(v for kind, v in self.tokens if kind == "hole")

    @property
    def literal(self) -> str | None:
        """The one name this template matches, if it has no holes or wildcards."""
        if any(kind != "text" for kind, _ in self.tokens):
            return None
        return "".join(v for _, v in self.tokens)

    @functools.cached_property
    def body(self) -> str:
        """The regular expression of the template, holes as named groups."""
        out = []
        for kind, value in self.tokens:
            if kind == "text":
                out.append(re.escape(value))
            elif kind == "hole":
                out.append(f"(?P<{value}>{INDEX})")
            else:
                out.append("[^.]*" if value == "*" else ".*")
        return "".join(out)

    @functools.cached_property
    def whole(self) -> re.Pattern:
        """Matches names this template matches whole."""
        return re.compile(self.body, re.DOTALL)

    @functools.cached_property
    def prefix(self) -> re.Pattern:
        """Matches names that this template matches, or whose leading parts it
        matches (`blocks` matches `blocks` and `blocks.attn.w`, not `blocks2`);
        the group `_rest` holds the rest, without its `.`."""
        return re.compile(self.body + r"(?:\.(?P<_rest>.*))?", re.DOTALL)

    def render(self, binding: dict[str, int]) -> str:
        out = []
        for kind, value in self.tokens:
            out.append(str(binding[value]) if kind == "hole" else value)
        return "".join(out)

    def __str__(self) -> str:
        return self.text


def parse(text: object, *, wildcards: bool, what: str) -> Template:
    """Parses `text` as a template; `what` names it in errors (`rule 3's
    "match"`). Wildcards are refused unless `wildcards`."""
    if not isinstance(text, str):
        raise TemplateError(f"{what} must be a string, not {type(text).__name__}")
    return _parse(text, wildcards, what)


@functools.lru_cache(maxsize=4096)
def _parse(text: str, wildcards: bool, what: str) -> Template:
    if not text:
        raise TemplateError(f"{what} is empty")
    if len(text) > MAX_LENGTH:
        raise TemplateError(
            f"{what} is {len(text)} characters long, more than the {MAX_LENGTH} "
            "a template may have"
        )
    tokens = _tokens(text, wildcards, what)
    _check_tokens(text, what, tokens)
    return Template(text, tuple(tokens))


# Escapes, holes (to the first `}`, checked below), wildcards, and literal text.
_TOKEN = re.compile(r"\{\{|\}\}|\{\*\}|\{[^}]*\}?|\}|\*\*?|[^{}*]+")
_ESCAPED = {"{{": "{", "}}": "}", "{*}": "*"}


def _tokens(text: str, wildcards: bool, what: str) -> list[tuple[str, str]]:
    """`text` cut into `("text", ...)`, `("hole", name)` and `("glob", "*" or
    "**")` tokens."""
    tokens: list[tuple[str, str]] = []
    for match in _TOKEN.finditer(text):
        found, at = match[0], match.start()
        if found in _ESCAPED or found[0] not in "{}*":
            token = ("text", _ESCAPED.get(found, found))
            if tokens and tokens[-1][0] == "text":
                token = ("text", tokens.pop()[1] + token[1])
        elif found[0] == "{":
            token = ("hole", _hole(text, found, at, what, tokens))
        elif found == "}":
            raise TemplateError(
                f"{what} {text!r} has a `}}` at {at} that closes no hole; write "
                "`}}` for a literal brace"
            )
        elif not wildcards:
            raise TemplateError(
                f"{what} {text!r} has a wildcard `*`, which this rule does not "
                "take: name the parts, with holes like `{i}` for indices"
            )
        else:
            token = ("glob", found)
        tokens.append(token)
    return tokens


def _hole(text: str, found: str, at: int, what: str, tokens) -> str:
    """The name of the hole `found` (`{name}`) at `at`, checked."""
    name = found[1:-1] if found.endswith("}") else ""
    if not _HOLE.fullmatch(name):
        raise TemplateError(
            f"{what} {text!r} has a `{{` at {at} that opens no hole like "
            "`{i}` (a lowercase name); write `{{` for a literal brace"
        )
    if name in (v for kind, v in tokens if kind == "hole"):
        raise TemplateError(f"{what} {text!r} has the hole `{{{name}}}` twice")
    return name


def _check_tokens(text: str, what: str, tokens: list[tuple[str, str]]) -> None:
    """Refuses too many holes or wildcards, and two that nothing separates."""
    holes = [v for kind, v in tokens if kind == "hole"]
    globs = [v for kind, v in tokens if kind == "glob"]
    if len(holes) > MAX_HOLES:
        raise TemplateError(
            f"{what} {text!r} has {len(holes)} holes, more than the {MAX_HOLES} allowed"
        )
    if len(globs) > MAX_WILDCARDS:
        raise TemplateError(
            f"{what} {text!r} has {len(globs)} wildcards, more than the "
            f"{MAX_WILDCARDS} allowed"
        )
    for (kind, value), (next_kind, next_value) in itertools.pairwise(tokens):
        if kind != "text" and next_kind != "text":
            raise TemplateError(
                f"{what} {text!r} has `{_shown(kind, value)}"
                f"{_shown(next_kind, next_value)}` with no text between: separate "
                "holes and wildcards by text (such as `.`)"
            )
        if (kind == "hole" and next_value[:1].isdigit()) or (
            next_kind == "hole" and value[-1:].isdigit()
        ):
            raise TemplateError(
                f"{what} {text!r} has a digit next to a hole: a hole must be "
                "between text that is not digits (such as `.`)"
            )


def _shown(kind: str, value: str) -> str:
    return f"{{{value}}}" if kind == "hole" else value


def escape(name: str) -> str:
    """A template that matches exactly `name`."""
    return name.replace("{", "{{").replace("}", "}}").replace("*", "{*}")


def binding(match: re.Match, holes: tuple[str, ...]) -> dict[str, int]:
    return {h: int(match.group(h)) for h in holes}
