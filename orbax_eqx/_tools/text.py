"""Text for the command line: byte sizes, cut values, aligned tables."""

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


def cut(text: str, limit: int = MAX_VALUE) -> str:
    """`text`, cut to `limit` characters with `...`."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(header: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    """Indented columns; the last column is never padded, so lines end cleanly."""
    widths = [
        min(max(len(r[i]) for r in [header, *rows]), _MAX_NAME_PAD)
        for i in range(len(header))
    ]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row[:-1], widths))
        ]
        lines.append(("  " + "  ".join([*cells, row[-1]])).rstrip())
    return "\n".join(lines)
