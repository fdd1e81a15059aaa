"""A failed save never keeps the process from exiting because of our threads.

What Orbax waits for: each commit future (`ocp.future.
CommitFutureAwaitingContractedSignals`) starts a thread at once, and that
thread first waits for the save's "directory made" signals (Orbax makes a
step's directories in the background: the step's, then each item's), for up
to Orbax's coordination timeout, 300 s. When Orbax fails to make a directory
(a name too long, a full disk, another save's directory in the way), those
signals never come; the threads are not daemons, so the process cannot exit
until they give up. Our handler starts such threads twice: for its own
writes, and inside the save of its inner Orbax handler (the arrays kept in
Orbax's store).

A thread inherits its daemon flag from the thread that makes it, so both are
made from a daemon thread here. They still finish every write of a save that
goes on: Orbax's own commit thread (not a daemon) waits for them before it
commits. What we cannot release is Orbax's own thread for an item directory
when the step directory could not be made; see the tests.
"""

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orbax.checkpoint as ocp

_T = TypeVar("_T")


def commit_future(coroutine: Coroutine[Any, Any, Any], *, name: str) -> Any:
    """`ocp.future.CommitFutureAwaitingContractedSignals(coroutine, name=name)`,
    whose thread does not hold the process at exit.

    **Arguments:**

    - `coroutine`: the writes, run once the save's directories are made.
    - `name`: the thread's name.

    **Returns:** the Orbax future.
    """
    return _in_daemon_thread(
        lambda: ocp.future.CommitFutureAwaitingContractedSignals(coroutine, name=name),
        name,
    ).result()


async def run(coroutine: Coroutine[Any, Any, _T], *, name: str) -> _T:
    """Awaits `coroutine` run on an event loop of its own in a daemon thread,
    so that every thread it starts is a daemon too.

    For Orbax's inner handler's `async_save`, whose commit futures start
    threads as `commit_future` does.
    """

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
