"""Progress hooks: the bridge's long operations report bytes done to the caller.

A caller (the command line) passes a function that, given the total bytes,
makes a context manager with `advance(nbytes)` (its progress bar); without
one, nothing is reported.
"""

from collections.abc import Callable
from typing import Any

Progress = Callable[[int], Any]


class Quiet:
    """Reports nothing."""

    def __init__(self, total: int):
        del total

    def advance(self, nbytes: int) -> None:
        del nbytes

    def __enter__(self) -> "Quiet":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
