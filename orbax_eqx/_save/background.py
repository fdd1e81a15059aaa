"""Errors of background writes say which save they stopped.

Orbax re-raises an error of an async save's background writes on the next
`save` or `wait_until_finished`, as it was raised: a `FileNotFoundError` or
"RESOURCE_EXHAUSTED ... No space left on device" that names a temporary file,
not the step. Each error from our writes gets a note (PEP 678, shown in the
traceback; `pytest.raises(match=...)` sees it too) naming the step and the
checkpoint; its type and message are left alone, so `except OSError` still
works.
"""

import contextlib
import os
from collections.abc import Awaitable, Iterator
from typing import Any

from etils import epath

from . import at_exit as _at_exit

# Orbax writes into `<name>.orbax-checkpoint-tmp[-<n>]` and renames on commit.
_TMP_MARK = ".orbax-checkpoint-tmp"


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


def _final_name(name: str) -> str:
    return name.split(_TMP_MARK)[0]


def _final(path: epath.Path) -> str:
    return os.path.join(os.fspath(path.parent), _final_name(path.name))


def _note(error: BaseException, where: str) -> None:
    _at_exit.ended(where)  # Orbax reports the error; nothing to finish at exit
    note = f"orbax_eqx: this error stopped the background save of {where}."
    if where.startswith("step "):
        note += " That step was not committed; the steps saved before it are intact."
    if note not in getattr(error, "__notes__", ()):  # re-raised: noted once
        error.add_note(note)


@contextlib.contextmanager
def noted(where: str) -> Iterator[None]:
    """Adds the note to any error raised in the block."""
    try:
        yield
    except Exception as e:
        _note(e, where)
        raise


async def noted_coroutine(coroutine: Awaitable[Any], where: str) -> Any:
    with noted(where):
        return await coroutine


class NotedFuture:
    """An Orbax future whose error, if any, carries the note.

    `explain`, if given, is called with the error first and may raise a
    clearer one in its place (see `claim.explain`).
    """

    def __init__(self, future: Any, where: str, explain: Any = None):
        self._future = future
        self._where = where
        self._explain = explain

    def result(self, timeout: float | None = None) -> Any:
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
    """Waits for every future, then raises the first error, if any.

    A save that fails must not return while other writes of it go on: they
    would write into a directory its caller then deletes.
    """
    first = None
    for f in futures:
        try:
            f.result()
        except Exception as e:
            first = first or e
    if first is not None:
        raise first
