"""Python's cyclic collector paused while a call the caller waits for builds
objects per leaf: an async save's prepare, a synchronous save, a restore;
never while an async save goes on in the background.

Each allocation counts towards the collector's thresholds, and each full
collection walks every live object of the process (BENCHMARKS.md, "Many small
leaves"). Nothing here makes cycles that must be collected meanwhile; the
collector is restored as it was when the last paused call returns.
"""

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # calls inside `paused()` now, in every thread
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Pauses the collector until the last nested or concurrent block ends."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
