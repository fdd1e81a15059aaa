"""A script that ends while a save of ours is under way still gets its step.

`mngr.save` returns before the step is written; a script that ends without
`mngr.wait_until_finished()` (or `mngr.close()`, or a `with` block) used to
lose its last step, after a wall of Orbax tracebacks and a 300 s wait:
Python's exit first shuts down every `concurrent.futures` executor ("cannot
schedule new futures after shutdown"), then joins the threads still running,
and Orbax's save thread then waits out its timeout for directories that are
never made.

So at exit, before those executors shut down, we wait for Orbax's save
threads to commit every step we are still saving, and print one line on
stderr naming the step and what to call. If the step still fails, a second
line says so (in place of Orbax's logged tracebacks), and that the steps
before it are intact.

CPython runs `threading._register_atexit` functions, last registered first,
before it joins threads; `concurrent.futures` registers its shutdown there
on import, which Orbax does before we register. `atexit.register` would run
only after the threads were joined: too late.
"""

import concurrent.futures.thread  # noqa: F401  (registers its shutdown first)
import logging
import sys
import threading

from etils import epath

# What a message calls a save under way (`step `3` (/ckpts/3/default)`, see
# `background.target`) -> the directory it is committed to.
_pending: dict[str, epath.Path | None] = {}
# Saves past our `finalize`, being renamed by Orbax: where -> final directory.
_committing: dict[str, epath.Path] = {}
_lock = threading.Lock()
# Orbax names the thread that waits for a save's writes and commits it.
_ORBAX_SAVE_THREAD = "async_save"


# Past this many records, those of committed saves are dropped (a handler
# that cannot say when its save is done leaves its records; see `started`).
_PRUNE_AT = 64


def started(where: str, final: epath.Path | None) -> None:
    """Records a save under way, to be committed to `final`.

    A record that `ended` never removes is harmless: at exit a save whose
    final directory exists counts as done.
    """
    with _lock:
        if len(_pending) >= _PRUNE_AT:
            for old, directory in list(_pending.items()):
                if directory is not None and directory.exists():
                    del _pending[old]
        _pending[where] = final


def ended(where: str) -> None:
    """The save failed (Orbax reports that error): nothing to finish at exit."""
    with _lock:
        _pending.pop(where, None)


def committing(where: str) -> None:
    """Our part of the save is done (`finalize`); Orbax renames its directory
    next, which still needs the executors that Python shuts down at exit. Kept
    among the last `_PRUNE_AT` such saves (no look at the store meanwhile):
    at exit, one whose final directory is not there yet is waited for. A save
    without a temporary directory has no rename to wait for."""
    with _lock:
        final = _pending.pop(where, None)
        if final is not None:
            _committing.pop(where, None)  # (a step saved again: the newest last)
            _committing[where] = final
            while len(_committing) > _PRUNE_AT:
                del _committing[next(iter(_committing))]  # the oldest


def _finish_at_exit() -> None:
    with _lock:
        saves = {**_committing, **_pending}
        _pending.clear()
        _committing.clear()
    threads = [
        t
        for t in threading.enumerate()
        if t.name == _ORBAX_SAVE_THREAD and t.is_alive()
    ]
    # Without a save thread of Orbax's nothing is in flight: what is left was
    # committed (on a process other than the primary host, which does not
    # finalize) or failed (Orbax raised that error).
    if not (saves and threads):
        return
    # A save counts as done once its final directory exists. Until Orbax has
    # renamed it, the thread still needs the executors (its commit runs there),
    # so it is waited for even after our `finalize` has returned.
    unsaved = {
        where: final
        for where, final in saves.items()
        if final is None or not final.exists()
    }
    if not unsaved:
        for thread in threads:  # what follows a commit (retention) ends too
            thread.join()
        return
    names = " and ".join(unsaved)
    was, it = ("was", "it") if len(unsaved) == 1 else ("were", "them")
    print(
        f"orbax_eqx: the script ended while {names} {was} still being saved; "
        f"finishing {it} now. Call `mngr.wait_until_finished()` (or `mngr.close()`, "
        "or use the manager in a `with` block) before a script ends.",
        file=sys.stderr,
        flush=True,
    )
    errors = _Quiet()
    logging.getLogger().addFilter(errors)
    logging.getLogger("absl").addFilter(errors)
    try:
        for thread in threads:
            thread.join()
    finally:
        logging.getLogger().removeFilter(errors)
        logging.getLogger("absl").removeFilter(errors)
    for where, final in unsaved.items():
        if final is not None and not final.exists():
            reason = f" ({errors.first})" if errors.first else ""
            print(
                f"orbax_eqx: {where} was not saved{reason}; the steps saved "
                "before it are intact.",
                file=sys.stderr,
                flush=True,
            )


class _Quiet(logging.Filter):
    """Keeps Orbax's logged errors (each with a traceback) off stderr while we
    wait at exit, and remembers the first for our own line."""

    def __init__(self):
        super().__init__()
        self.first: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if self.first is None:
            exc = record.exc_info[1] if record.exc_info else None
            self.first = str(exc) if exc is not None else record.getMessage()
            self.first = self.first.splitlines()[0] if self.first else None
        return False


_register = getattr(threading, "_register_atexit", None)
if _register is not None:  # CPython 3.9+
    _register(_finish_at_exit)
