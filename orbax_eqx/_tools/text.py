"""Text for the command line: byte sizes, cut values, aligned tables, and text
from a checkpoint made safe to print."""

import re

MAX_VALUE = 72  # longer descriptions are cut in text output
_MAX_NAME_PAD = 56  # longer names push their row out rather than widen every row


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


# Control characters: C0 (ESC, CR, BEL, newline...), DEL and C1. Printed raw, a
# leaf name of a hostile checkpoint could move the cursor, recolor or clear
# the terminal, or fake lines of a report.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def printable(text: str) -> str:
    """`text` with every control character escaped (`\\x1b`, `\\n`): one line,
    inert on a terminal. For names and values read from a checkpoint."""
    if text.isascii() and text.isprintable():  # most text: nothing to escape
        return text
    return _CONTROL.sub(_escape, text)


def printable_lines(text: str) -> str:
    """`text` with control characters other than newline and tab escaped."""
    return _CONTROL_BUT_LINES.sub(_escape, text)


def cut(text: str, limit: int = MAX_VALUE) -> str:
    """`text`, cut to `limit` characters with `...`."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(
    header: list[str],
    rows: list[list[str]],
    right: tuple[int, ...] = (),
    max_pad: int | None = _MAX_NAME_PAD,
) -> str:
    """Indented columns; the last column is never padded, so lines end cleanly.
    Every cell is one line: control characters in it are escaped. A cell
    longer than `max_pad` pushes its row out rather than widen every row;
    `max_pad=None` aligns every row, however long."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    if max_pad is not None:
        widths = [min(w, max_pad) for w in widths]
    header = [printable(cell) for cell in header]
    rows = [[printable(cell) for cell in row] for row in rows]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row[:-1], widths, strict=False))
        ]
        lines.append(("  " + "  ".join([*cells, row[-1]])).rstrip())
    return "\n".join(lines)
