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
    def has_wildcards(self) -> bool:
        return any(kind == "glob" for kind, _ in self.tokens)

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


def _tokens(text: str, wildcards: bool, what: str) -> list[tuple[str, str]]:
    """`text` cut into `("text", ...)`, `("hole", name)` and `("glob", "*" or
    "**")` tokens."""
    tokens: list[tuple[str, str]] = []
    literal: list[str] = []

    def flush():
        if literal:
            tokens.append(("text", "".join(literal)))
            literal.clear()

    i = 0
    while i < len(text):
        c = text[i]
        if text.startswith("{{", i) or text.startswith("}}", i):
            literal.append(c)
            i += 2
        elif text.startswith("{*}", i):
            literal.append("*")
            i += 3
        elif c == "{":
            end = text.find("}", i)
            name = text[i + 1 : end] if end >= 0 else ""
            if end < 0 or not _HOLE.fullmatch(name):
                raise TemplateError(
                    f"{what} {text!r} has a `{{` at {i} that opens no hole like "
                    "`{i}` (a lowercase name); write `{{` for a literal brace"
                )
            if name in (v for kind, v in tokens if kind == "hole"):
                raise TemplateError(f"{what} {text!r} has the hole `{{{name}}}` twice")
            flush()
            tokens.append(("hole", name))
            i = end + 1
        elif c == "}":
            raise TemplateError(
                f"{what} {text!r} has a `}}` at {i} that closes no hole; write "
                "`}}` for a literal brace"
            )
        elif c == "*":
            if not wildcards:
                raise TemplateError(
                    f"{what} {text!r} has a wildcard `*`, which this rule does not "
                    "take: name the parts, with holes like `{i}` for indices"
                )
            flush()
            double = text.startswith("**", i)
            tokens.append(("glob", "**" if double else "*"))
            i += 2 if double else 1
        else:
            literal.append(c)
            i += 1
    flush()
    return tokens


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
