"""A progress bar for long commands, drawn only when stderr is a terminal."""

import sys
import time
from typing import TextIO

from .text import human_bytes

_WIDTH = 30
_INTERVAL = 0.1  # seconds between redraws


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
        self.done = 0
        self._stream = sys.stderr if stream is None else stream
        # The CLI's stderr escapes control characters; the bar's own are
        # written past it (`write_raw`).
        self._write = getattr(self._stream, "write_raw", self._stream.write)
        isatty = getattr(self._stream, "isatty", None)
        self.enabled = bool(isatty and isatty())
        self._last = 0.0
        self._drawn = False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last >= _INTERVAL or self.done >= self.total):
            self._last = now
            self._draw()

    def _draw(self) -> None:
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        self._write(
            f"\r{self.label} [{bar}] {fraction:4.0%} "
            f"{human_bytes(self.done)} / {human_bytes(self.total)}\x1b[K"
        )
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erases the bar, so that what follows starts on a clean line."""
        if self._drawn:
            self._write("\r\x1b[K")
            self._stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
