"""The futures a save hands Orbax: errors that name the save, threads that never
hold the process.

Orbax re-raises an error of a background write on the next `save` or
`wait_until_finished` as it was raised (a `FileNotFoundError` naming a
temporary file, not the step). Each gets a note (PEP 678) naming the step and
the checkpoint; its type and message are left alone.

Each commit future (`ocp.future.CommitFutureAwaitingContractedSignals`) starts
a thread that first waits for the save's "directory made" signals, for up to
Orbax's timeout (300 s); when Orbax fails to make a directory they never come.
A thread inherits its daemon flag from the thread that makes it, so ours are
made from a daemon thread: a failed save does not keep the process from
exiting. Orbax's own commit thread (not a daemon) still waits for them.
"""

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import orbax.checkpoint as ocp
from etils import epath

from . import at_exit as _at_exit

_T = TypeVar("_T")
# Orbax writes into `<name>.orbax-checkpoint-tmp[-<n>]` and renames on commit
# (on `gs://` it writes in place and commits by a file instead).
_TMP_MARK = ocp.path.atomicity.TMP_DIR_SUFFIX


def target(directory: epath.Path) -> str:
    """What is being saved to `directory`: `step `3` (/ckpts/3/default)`."""
    directory = epath.Path(directory)
    final = os.path.join(_final(directory.parent), _final_name(directory.name))
    if _TMP_MARK in directory.parent.name:  # an item inside a step being saved
        return f"step `{_final_name(directory.parent.name)}` ({final})"
    return final


def final_directory(directory: epath.Path) -> epath.Path | None:
    """Where Orbax will rename `directory` on commit; None if it is no temporary."""
    directory = epath.Path(directory)
    if _TMP_MARK in directory.parent.name:  # an item of a step being saved
        return epath.Path(_final(directory.parent)) / _final_name(directory.name)
    if _TMP_MARK in directory.name:  # a standalone save (`oeqx.save`)
        return epath.Path(_final(directory))
    return None


def step_and_item(directory: epath.Path) -> tuple[str, str] | None:
    """The names of the step directory and item that `directory`, an item of a
    step being saved, has once Orbax commits it; None for a directory that is
    itself the checkpoint being renamed into place (`ocp.Checkpointer`)."""
    directory = epath.Path(directory)
    if _TMP_MARK in directory.name and _TMP_MARK not in directory.parent.name:
        return None
    return _final_name(directory.parent.name), _final_name(directory.name)


def _final_name(name: str) -> str:
    return name.split(_TMP_MARK)[0]


def _final(path: epath.Path) -> str:
    return os.path.join(os.fspath(path.parent), _final_name(path.name))


@contextlib.contextmanager
def noted(where: str) -> Iterator[None]:
    """Adds the note naming the save `where` to any error raised in the block."""
    try:
        yield
    except Exception as e:
        _at_exit.ended(where)  # Orbax reports the error; nothing to finish at exit
        note = f"orbax_eqx: this error stopped the background save of {where}."
        if where.startswith("step "):
            note += (
                " That step was not committed; the steps saved before it are intact."
            )
        if note not in getattr(e, "__notes__", ()):  # re-raised: noted once
            e.add_note(note)
        raise


class NotedFuture:
    """An Orbax future whose error, if any, carries the note; the threads that
    wait on it are noted for the exit (`at_exit.waiting`). `explain`, if given,
    is called with the error first and may raise a clearer one."""

    def __init__(self, future: Any, where: str, explain: Any = None):
        self._future = future
        self._where = where
        self._explain = explain

    def result(self, timeout: float | None = None) -> Any:
        _at_exit.waiting(self._where)
        with noted(self._where):
            try:
                return self._future.result(timeout=timeout)
            except Exception as e:
                if self._explain is not None:
                    self._explain(e)
                raise

    def cancel(self) -> bool | None:
        cancel = getattr(self._future, "cancel", None)
        return cancel() if cancel is not None else None


def wait_all(futures: list[Any]) -> None:
    """Waits for every future, then raises the first error: a failed save must
    not return while other writes of it go on into a directory then deleted."""
    first = None
    for f in futures:
        try:
            f.result()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first


def commit_future(coroutine: Coroutine[Any, Any, Any], *, name: str) -> Any:
    """`ocp.future.CommitFutureAwaitingContractedSignals(coroutine, name=name)`,
    whose thread does not hold the process at exit."""
    return _in_daemon_thread(
        lambda: ocp.future.CommitFutureAwaitingContractedSignals(coroutine, name=name),
        name,
    ).result()


async def run(coroutine: Coroutine[Any, Any, _T], *, name: str) -> _T:
    """Awaits `coroutine` on an event loop of its own in a daemon thread, so
    that every thread it starts is a daemon too (the inner Orbax handler's
    `async_save`, whose commit futures start threads as `commit_future` does)."""

    def on_own_loop() -> _T:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coroutine)
        finally:
            loop.close()

    return await asyncio.wrap_future(_in_daemon_thread(on_own_loop, name))


def _in_daemon_thread(
    fn: Callable[[], _T], name: str
) -> "concurrent.futures.Future[_T]":
    done: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # raised where the result is taken
            done.set_exception(e)

    threading.Thread(target=call, name=f"{name}_start", daemon=True).start()
    return done
