"""Text for people: sizes, tables, the tree of a checkpoint, errors, progress.

Everything the command line prints goes through here. Text read from a
checkpoint is made inert first (`printable`): a leaf name cannot move the
cursor or fake a line of the report.
"""

import json
import math
import re
import sys
import time
from typing import Any, TextIO

from .._errors import first_line, inline_list, some
from .._format.sidecar import ALIAS, EMPTY, PACKED, SHARDS, STORED, Metadata
from .._orbax.plain import PYTHON, without_specs
from .._tree.names import ESCAPE, SEPARATOR
from .._tree.values import describe, scalar_type
from .._tree.walk import ARRAY, NUMPY, NUMPY_SCALAR, SCALAR, SHARED, display_path

PROG = "orbax_eqx"
MAX_VALUE = 72  # longer values are cut in tables
MAX_PROBLEMS = 10  # problems listed in an error, one a line; the rest counted
MAX_LINE = 1000  # characters of a line of an error, at most
_MAX_PAD = 56  # a longer cell pushes its row out rather than widen every row


def human_bytes(n: int) -> str:
    """`n` bytes in binary units: `512 B`, `1.5 KiB`, `3.0 GiB`."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1023.95:
            break
    return f"{value:.1f} {unit}"


def count(n: int, word: str, words: str | None = None) -> str:
    """`1 step`, `3 steps` (`words`: the plural, if not `word` + s)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


# Control characters (C0, DEL, C1): printed raw, a name could drive the terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def printable(text: str) -> str:
    """`text` with every control character escaped: one inert line."""
    if text.isascii() and text.isprintable():
        return text
    return _CONTROL.sub(_escape, text)


def printable_lines(text: str) -> str:
    """`text` with control characters other than newline and tab escaped."""
    return _CONTROL_BUT_LINES.sub(_escape, text)


def number(x: float | None, digits: int = 4) -> str:
    """`x` in `digits` significant digits; `-` for None (no number to give)."""
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.{digits}g}" if math.isfinite(x) else str(x)


def cut(text: str, limit: int = MAX_VALUE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(header, rows, right=(), max_pad: int | None = _MAX_PAD) -> str:
    """Indented columns (`right`: those aligned right); the last column is not
    padded, and a cell longer than `max_pad` pushes its row out."""
    rows = [[printable(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    widths = [min(w, max_pad) if max_pad else w for w in widths]
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row[:-1], widths, strict=False))
        ]
        lines.append(("  " + "  ".join([*cells, row[-1]])).rstrip())
    return "\n".join(lines)


def handler_text(handler: str | None) -> str:
    """A handler Orbax recorded, as people name it: `StandardCheckpointHandler`,
    `PyTreeHandler (Orbax v1)`."""
    if handler is None:
        return "handler not recorded"
    short = handler.rsplit(".", 1)[-1]
    return f"{short} (Orbax v1)" if ".v1." in f".{handler}" else short


# ---------------------------------------------------------------- errors

# The library's options, as the command line spells them: its errors name
# the fix in Python terms, and here they are said in flags.
FLAGS = {
    "`cast=True`": "--cast",
    "`allow_unused=True`": "--allow-unused",
    "`ignore_static=True`": "--ignore-static",
    "`overwrite=True`": "--overwrite",
    "`mapping=`": "--mapping (or --rename)",
}
_FLAG = re.compile("|".join(re.escape(k) for k in FLAGS))
_NAME = re.compile(r"`[^`]*`")
_MORE = re.compile(r"\.\.\. and (\d+) more\.?")


def error_lines(error: BaseException) -> list[str]:
    """What `error` says, for a person: its lines in order, with the library's
    options said as flags; each run of `- ` items one problem a line, alike
    ones grouped, at most `MAX_PROBLEMS` (the rest counted); TensorStore's
    specs left out, and every line cut to `MAX_LINE`."""
    out: list[str] = []
    run: list[str] = []
    more = 0
    for line in [*_lines(error), ""]:
        capped = _MORE.fullmatch(line)
        if line.startswith("- ") or (capped and run):
            run += [line[2:]] if not capped else []
            more += int(capped[1]) if capped else 0
            continue
        if run:  # a run of items ends
            listed = _grouped(run)
            more += max(len(listed) - MAX_PROBLEMS, 0)
            out += [f"  - {p}" for p in listed[:MAX_PROBLEMS]]
            out += [f"  ... and {more} more"] if more else []
            run, more = [], 0
        out += [line] if line else []
    out = out or [type(error).__name__]
    return [cut(printable(_FLAG.sub(lambda m: FLAGS[m[0]], x)), MAX_LINE) for x in out]


def _lines(error: BaseException) -> list[str]:
    """The lines of an error: from its fields where it has them (`head`,
    `problems`, `fixes`), else from its message."""
    head, problems = getattr(error, "head", None), getattr(error, "problems", None)
    if (
        head
        and isinstance(problems, list)
        and all(isinstance(p, str) for p in problems)
    ):
        fixes = getattr(error, "fixes", None) or []
        found = [f"{head}:", *(f"- {p}" for p in problems)]
        return found + ([f"To fix: {'; '.join(fixes)}."] if fixes else [])
    text = without_specs(str(error)).strip()
    return [x.strip() for x in text.splitlines() if x.strip()]


def _grouped(problems: list[str]) -> list[str]:
    """Problems that differ only in the first name they quote, as one: the
    first, then the names of the others."""
    groups: dict[str, list[str]] = {}
    for p in problems:
        groups.setdefault(_NAME.sub("``", p, count=1), []).append(p)
    out = []
    for group in groups.values():
        first, others = group[0], group[1:]
        if others:
            names = [(_NAME.findall(p) or [p])[0] for p in others]
            end = "." if first.endswith(".") else ""
            first = (
                f"{first.removesuffix('.')}; {len(others)} more alike: {some(names)}"
            )
            first += end
        out.append(first)
    return out


def unforeseen(command: str, error: BaseException) -> str:
    return (
        f"{command} failed: {type(error).__name__}: "
        f"{cut(first_line(error), MAX_LINE)} (--debug shows the traceback)"
    )


def print_error(lines: list[str]) -> None:
    print(f"{PROG}: error: " + "\n".join(lines), file=sys.stderr)


# ---------------------------------------------------------------- progress


class Progress:
    """A bar of `total` bytes on `stream` (default stderr), drawn only when it
    is a terminal, at most every 0.1 s, and erased at the end; `advance(n)`
    counts `n` more done."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None):
        stream = sys.stderr if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        self.label, self.total, self.done = label, total, 0
        self._on = bool(isatty and isatty()) and total > 0
        # Past the escaping of control characters: the carriage returns must
        # reach the terminal.
        self._write, self._flush = (
            getattr(stream, "write_raw", stream.write),
            stream.flush,
        )
        self._drawn, self._width = -1.0, 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self._on and (now - self._drawn >= 0.1 or self.done >= self.total):
            share = min(self.done / self.total, 1.0)
            bar = f"{'#' * int(30 * share):.<30}"
            text = f"{self.label} [{bar}] {100 * share:3.0f}% {human_bytes(self.done)}"
            text += f" / {human_bytes(self.total)}"
            self._write("\r" + text.ljust(self._width))
            self._flush()
            self._drawn, self._width = now, max(self._width, len(text))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._width:
            self._write("\r" + " " * self._width + "\r")
            self._flush()


# ---------------------------------------------------------------- trees

# Rows hold at most this many name parts in all (a row counts every part of
# its name): models come nowhere near (50,000 leaves make ~250,000); a
# hand-made sidecar naming a leaf with 100,000 parts would make 5 billion.
MAX_LAID_OUT = 4_000_000
# A run of this many alike list items or more shows the first and one row.
FOLD = 3
STORED_IN = {PACKED: "pack", SHARDS: "shard packs", STORED: "Orbax"}
_INDENT = "  "


def split(name: str) -> list[str]:
    """The parts of a leaf name, split at unescaped separators (kept escaped)."""
    if ESCAPE not in name:
        return name.split(SEPARATOR)
    parts, current, chars = [], "", iter(name)
    for c in chars:
        if c == ESCAPE:
            current += c + next(chars, "")
        elif c == SEPARATOR:
            parts.append(current)
            current = ""
        else:
            current += c
    return [*parts, current]


class Node:
    """A node of the tree: one per name part (slots: there are many)."""

    __slots__ = ("children", "leaf", "module", "nbytes", "params", "kind")

    def __init__(self) -> None:
        self.children: dict[str, Node] = {}
        self.leaf: Any = None
        self.module: str | None = None  # the module's name in the sidecar
        self.nbytes = self.params = 0  # of the arrays stored under it
        self.kind = 0  # nodes whose rows would be alike have one kind


class Tree:
    """The leaves of `saved` by name part, in the sidecar's order, parents
    before children in `nodes`; `left_out`: leaves past `MAX_LAID_OUT`."""

    def __init__(self, saved: Metadata):
        self.saved = saved
        self.root = Node()
        self.nodes = [self.root]
        self.left_out: list[str] = []
        laid_out = 0
        for name, leaf in saved.leaves.items():
            parts = split(name) if name else []
            path = [self.root]
            for part in parts:
                child = path[-1].children.get(part)
                if child is None:
                    break
                path.append(child)
            have, depth = len(path) - 1, len(parts)
            cost = (depth * (depth + 1) - have * (have + 1)) // 2  # new rows' parts
            if laid_out + cost > MAX_LAID_OUT:
                self.left_out.append(name)
                continue
            laid_out += cost
            for part in parts[have:]:
                path.append(path[-1].children.setdefault(part, Node()))
                self.nodes.append(path[-1])
            path[-1].leaf = leaf
            if leaf.kind == ARRAY and leaf.data in (STORED, PACKED, SHARDS):
                for node in path:
                    node.nbytes += leaf.nbytes
                    node.params += math.prod(leaf.shape or ())
        for module in saved.modules:
            found = self.find(split(module) if module else [])
            if found is not None:
                found.module = module

    def find(self, parts: list[str]) -> Node | None:
        node: Node | None = self.root
        for part in parts:
            node = node.children.get(part) if node is not None else None
        return node

    def left_out_line(self) -> list[str]:
        if not self.left_out:
            return []
        names = inline_list([cut(display_path(x)) for x in self.left_out])
        return [
            f"Not laid out ({len(self.left_out)}): {names}: the tree lays out at "
            f"most {MAX_LAID_OUT:,} name parts in all (a row counts every part of "
            "its name), and these names would take it past that. `inspect --flat` "
            "or `--json` lists every leaf."
        ]

    def rows(self, shardings: dict[str, str], every: bool) -> list[list[str]]:
        """`[name, type, shape, bytes, stored in, sharding, value]` rows, names
        indented; runs of `FOLD` alike list items folded unless `every`."""
        if not every:
            self._kinds(shardings)
        out: list[list[str]] = []
        root = self.root
        if root.leaf is not None:  # the whole tree is one leaf
            return [self._leaf_row(root.leaf, "<root>", shardings)]
        stack = [(iter(self._entries(root, every)), 0)]
        if root.module is not None:
            out.append(self._module_row(root, "<root>"))
            stack = [(stack[0][0], 1)]
        while stack:  # depth first without recursion: models nest deep
            entries, depth = stack[-1]
            for part, child in entries:
                if isinstance(child, list):  # a folded run
                    out.append(self._run_row(child, depth))
                elif child.leaf is not None and not child.children:
                    out.append(
                        self._leaf_row(child.leaf, _INDENT * depth + part, shardings)
                    )
                else:
                    out.append(self._module_row(child, _INDENT * depth + part))
                    stack.append((iter(self._entries(child, every)), depth + 1))
                    break
            else:
                stack.pop()
        return out

    def _entries(self, node: Node, every: bool) -> list[tuple[str, Any]]:
        """The children of `node`; unless `every`, each run of `FOLD` or more
        alike list items (consecutive indices) as its first and then the rest
        as one `[first index, last index, like, nodes]`."""
        items = list(node.children.items())
        if every:
            return items
        out: list[tuple[str, Any]] = []
        i = 0
        while i < len(items):
            part, first = items[i]
            j = i + 1
            index = _index(part)
            while (
                index is not None
                and j < len(items)
                and _index(items[j][0]) == index + j - i
                and items[j][1].kind == first.kind
            ):
                j += 1
            out.append(items[i])
            if j - i >= FOLD:
                nodes = [n for _, n in items[i + 1 : j]]
                out.append(("", [items[i + 1][0], items[j - 1][0], part, nodes]))
            else:
                out += items[i + 1 : j]
            i = j
        return out

    def _run_row(self, run: list, depth: int) -> list[str]:
        first_index, last_index, like, nodes = run
        first = nodes[0]
        if first.leaf is not None and not first.children:
            row = self._leaf_row(first.leaf, "", {})
            row[4] = row[5] = ""
        else:
            row = self._module_row(first, "")
        row[0] = f"{_INDENT * depth}{first_index} .. {last_index}"
        row[3] = human_bytes(sum(n.nbytes for n in nodes))
        row[-1] = f"{len(nodes)} more, each like {like} (--all shows them)"
        return row

    def _module_row(self, node: Node, label: str) -> list[str]:
        cls = static = ""
        if node.module is not None:
            info = self.saved.modules[node.module]
            cls = info.cls.rsplit(".", 1)[-1]
            # Every field, each cut short: static fields tell models apart.
            static = ", ".join(
                f"{k}={cut(describe(v), 40)}" for k, v in info.static.items()
            )
        size = human_bytes(node.nbytes) if node.nbytes else ""
        return [label, cls, "", size, "", "", static]

    def _leaf_row(self, leaf: Any, label: str, shardings: dict[str, str]) -> list[str]:
        if leaf.kind != ARRAY:
            return [label, type_text(leaf), "", "", "", "", cut(value_text(leaf))]
        source = leaf
        if leaf.data == ALIAS and leaf.alias_of in self.saved.leaves:
            source = self.saved.source(leaf)
        return [
            label,
            str(leaf.dtype),
            str(tuple(leaf.shape or ())),
            human_bytes(leaf.nbytes),
            STORED_IN.get(source.data or "", ""),
            shardings.get(leaf.name, ""),
            value_text(leaf),
        ]

    def _kinds(self, shardings: dict[str, str]) -> None:
        """Sets `node.kind` alike for nodes whose rows would be alike but for
        their names, all the way down: children first, without recursion."""
        kinds: dict[tuple, int] = {}
        for node in reversed(self.nodes):
            module = (
                self.saved.modules.get(node.module) if node.module is not None else None
            )
            key = (
                None if module is None else (module.cls, _static_key(module.static)),
                None
                if node.leaf is None
                else tuple(self._leaf_row(node.leaf, "", shardings)),
                tuple((p, c.kind) for p, c in node.children.items()),
            )
            node.kind = kinds.setdefault(key, len(kinds))


def _static_key(static: dict[str, Any]) -> str:
    # Fields recorded alike print alike; text with lone surrogates (from old
    # saves) has no JSON, and is told apart by its repr.
    return json.dumps(static, default=repr, ensure_ascii=True)


def _index(part: str) -> int | None:
    """A list index as a name part says it (ASCII digits, not too many)."""
    if len(part) <= 30 and part.isascii() and part.isdigit():
        return int(part)
    return None


def type_text(leaf: Any) -> str:
    if leaf.kind == ARRAY:
        return str(leaf.dtype)
    if leaf.kind == SCALAR:
        return scalar_type(leaf.value) or SCALAR
    return leaf.kind


def value_text(leaf: Any) -> str:
    if leaf.kind == SHARED:
        return "placeholder for a node tied by eqx.nn.Shared"
    if leaf.kind != ARRAY:
        return describe(leaf.value)
    notes = {
        NUMPY: "numpy array",
        NUMPY_SCALAR: "numpy scalar",
        PYTHON: "Python scalar",
    }
    found = [notes[leaf.container]] if leaf.container in notes else []
    if leaf.data == EMPTY:
        found.append("zero-size")
    elif leaf.data == ALIAS:
        found.append(f"same array as {leaf.alias_of}")
    return ", ".join(found)
