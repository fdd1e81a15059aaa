"""Runs what might block on a FIFO, in a thread with a time limit.

A read blocked on a FIFO cannot be interrupted, but it ends when a writer
opens the FIFO and closes it: past the limit the test does that, then fails,
so that a regression fails the test instead of hanging the run.
"""

import os
import threading

import pytest

LIMIT_S = 30


def raised_by(run, fifo, limit_s: float = LIMIT_S) -> BaseException | None:
    """Runs `run()` in a thread; returns what it raised (None if nothing).
    Fails the test if it is still running after `limit_s` seconds, blocked
    on `fifo` (which is then opened for writing and closed: the read ends)."""
    raised = []

    def target():
        try:
            run()
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the read
        except OSError:  # no reader: blocked elsewhere; the thread is a daemon
            pass
        thread.join(limit_s)
        pytest.fail(f"still running after {limit_s} s, blocked on {fifo}?")
    return raised[0] if raised else None
