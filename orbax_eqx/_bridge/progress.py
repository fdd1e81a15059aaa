"""Progress hooks: given the total bytes, the caller's function makes a context
manager whose `advance(nbytes)` is called as they are done."""

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
