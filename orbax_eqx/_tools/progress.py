"""A progress bar for long commands (tqdm's), drawn only when stderr is a
terminal."""

import sys
from typing import Any, TextIO

from tqdm import tqdm

from .text import human_bytes

_FORMAT = "{desc} [{bar:30}] {percentage:3.0f}% {done} / {whole}"
_INTERVAL = 0.1  # seconds between redraws


class _Bar(tqdm):
    """tqdm's bar, with sizes written as the rest of the command line writes
    them (`1.5 GiB`)."""

    monitor_interval = 0  # no monitor thread: every redraw is in `update`

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        d["done"] = human_bytes(d["n"])
        d["whole"] = human_bytes(d["total"])
        return d


class _Raw:
    """Writes past the CLI's stderr, which escapes control characters: the
    bar's own carriage returns must reach the terminal."""

    def __init__(self, stream: TextIO):
        self._write = getattr(stream, "write_raw", stream.write)
        self._stream = stream

    def write(self, text: str) -> None:
        self._write(text)

    def flush(self) -> None:
        self._stream.flush()


class Progress:
    """Counts bytes done out of `total`, and shows it on a terminal.

    In a pipe or a file (`stream.isatty()` false), it writes nothing at all.

    **Arguments:**

    - `label`: what is being done, such as `"export"`.
    - `total`: the bytes to do.
    - `stream`: where to draw; default `sys.stderr`.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = None):
        self.label = label
        self.total = total
        stream = sys.stderr if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        self.enabled = bool(isatty and isatty())
        self._bar = _Bar(
            total=total,
            desc=label,
            file=_Raw(stream),
            disable=not self.enabled or total <= 0,  # (nothing to count)
            leave=False,  # erased at the end: what follows starts on a clean line
            ascii=".#",
            bar_format=_FORMAT,
            mininterval=_INTERVAL,
            dynamic_ncols=False,
        )

    @property
    def done(self) -> int:
        return int(self._bar.n)

    def advance(self, nbytes: int) -> None:
        self._bar.update(nbytes)
        if self._bar.n >= self.total:  # the end is drawn, however soon it came
            self._bar.refresh()

    def close(self) -> None:
        """Erases the bar, so that what follows starts on a clean line."""
        self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
