"""A background save's Python work, made to share the interpreter.

A save's background thread names thousands of leaves and builds the sidecar:
Python work, which holds the GIL. A thread that waits for the GIL asks for it
only after the interpreter's switch interval (5 ms), and the training loop's
thread waits for it at every blocking call it makes (Orbax's own steps after
the handler returns start threads and touch files): measured on a 6,313-leaf
model, a save blocked 0.21 s longer while its background thread walked the
tree. So the background work pauses, briefly, every `EVERY` seconds.
"""

import time

EVERY = 0.002  # seconds of work between pauses
REST = 0.0001  # seconds a pause lasts: long enough for a waiting thread to run


class Polite:
    """Called once per unit of work (a leaf, a module); now and then sleeps
    for `REST`, so that other threads get the GIL within about `EVERY`."""

    def __init__(self):
        self._count = 0
        self._due = time.perf_counter() + EVERY

    def __call__(self) -> None:
        self._count += 1
        if self._count & 31:  # the clock is read every 32 units of work
            return
        if time.perf_counter() >= self._due:
            time.sleep(REST)
            self._due = time.perf_counter() + EVERY
