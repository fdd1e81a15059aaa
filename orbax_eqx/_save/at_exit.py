"""A script that ends while a save of ours is under way still gets its step.

`mngr.save` returns before the step is written. At exit Python shuts down
every `concurrent.futures` executor before it joins the threads still running,
and Orbax's thread that commits the step needs one ("cannot schedule new
futures after shutdown"). So at exit we first wait for our saves to be
committed, saying so in one line on stderr: we join the thread that called our
`finalize`, else wait for the save's final directory while a thread that
waited on its futures (`waiting`) runs.
`threading._register_atexit` is the one hook that runs before those executors
shut down (`atexit` runs after the threads are joined: too late).
"""

import concurrent.futures.thread  # noqa: F401  (registers its shutdown first)
import dataclasses
import sys
import threading
import time

from etils import epath


@dataclasses.dataclass
class _Save:
    final: epath.Path | None  # the directory it is renamed to on commit
    committer: threading.Thread | None = None  # the thread that finalized it
    waiters: list[threading.Thread] = dataclasses.field(default_factory=list)


# What a message calls a save under way (`step `3` (/ckpts/3/default)`, see
# `futures.target`) -> the save.
_saves: dict[str, _Save] = {}
_lock = threading.Condition()
_MAX = 64  # records kept of saves that never say they are done
_WAIT_S = 300.0  # Orbax's own timeout for a save's directories
_WAITER_S = 2.0  # for a thread to start waiting on a save's futures


def started(where: str, final: epath.Path | None) -> None:
    """Records a save under way; forgets those done (committed by a thread
    that has ended, or by this one: a save that waited)."""
    me = threading.current_thread()
    with _lock:
        for old, save in list(_saves.items()):
            if save.committer is me or (
                save.committer and not save.committer.is_alive()
            ):
                del _saves[old]
        if len(_saves) >= _MAX:
            del _saves[next(iter(_saves))]  # the oldest
        _saves[where] = _Save(final)


def waiting(where: str) -> None:
    """The calling thread waits on the save's futures (and may commit it)."""
    with _lock:
        save = _saves.get(where)
        if save is not None and threading.current_thread() not in save.waiters:
            save.waiters.append(threading.current_thread())
            _lock.notify_all()


def ended(where: str) -> None:
    """The save failed (Orbax reports that error): nothing to finish at exit."""
    with _lock:
        _saves.pop(where, None)
        _lock.notify_all()


def committing(where: str) -> None:
    """Our part of the save is done (`finalize`, in the thread that commits)."""
    with _lock:
        save = _saves.get(where)
        if save is not None and save.final is None:
            del _saves[where]  # no rename to wait for
        elif save is not None:
            save.committer = threading.current_thread()
        _lock.notify_all()


def _finish_at_exit() -> None:
    me = threading.current_thread()
    start = time.monotonic()
    with _lock:  # a thread about to wait on a save's futures gets a moment
        _lock.wait_for(
            lambda: all(s.waiters or s.committer for s in _saves.values()), _WAITER_S
        )
        saves = {w: s for w, s in _saves.items() if _live(s, me)}
    unsaved = [w for w, s in saves.items() if not (s.final and s.final.exists())]
    if unsaved:
        names = " and ".join(unsaved)
        was, it = ("was", "it") if len(unsaved) == 1 else ("were", "them")
        _say(
            f"the script ended while {names} {was} still being saved; finishing "
            f"{it} now. Call `mngr.wait_until_finished()` (or `mngr.close()`, or "
            "use the manager in a `with` block) before a script ends."
        )
    for where, save in saves.items():
        _wait_for(where, save, me, start)
    for where in unsaved:
        final = saves[where].final
        if final is not None and not final.exists():
            _say(
                f"{where} was not saved (see the error above); the steps saved "
                "before it are intact."
            )


def _wait_for(where: str, save: _Save, me: threading.Thread, start: float) -> None:
    """Until the save is finalized, fails, or is committed elsewhere."""
    with _lock:
        while not _known(where, save, time.monotonic() - start):
            _lock.wait(0.05)
    if save.committer is not None and save.committer is not me:
        save.committer.join()


def _live(save: _Save, me: threading.Thread) -> bool:
    """Whether a thread that may still commit the save runs."""
    threads = [save.committer] if save.committer else save.waiters
    return any(t is not me and t.is_alive() for t in threads)


def _known(where: str, save: _Save, waited: float) -> bool:
    """Whether the save's outcome is known, or nothing may still commit it."""
    if save.committer is not None or where not in _saves or waited > _WAIT_S:
        return True
    if save.final is not None and save.final.exists():
        return True
    return not any(t.is_alive() for t in save.waiters)


def _say(text: str) -> None:
    print(f"orbax_eqx: {text}", file=sys.stderr, flush=True)


threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]
