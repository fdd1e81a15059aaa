"""The interface between what is stored and where its bytes go.

A `Store` reads and writes files named by full paths (`/ckpt/7/default/x`,
`gs://bucket/run/7/default/x`). It knows nothing of what the bytes mean; the
caller words every error about a file's contents. This module is the
interface only: `route.for_path` picks the store from a path, and the
implementations (`local`, `objects`) import this module, never the reverse.
"""

import abc
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

ErrorFor = Callable[[str], Exception]


class BadFile(Exception):
    """A file that is missing, of the wrong length, or ends early.

    `what` completes a sentence about the file ("is missing", "has 10 bytes
    where 12 were written"); the caller turns it into its own error.
    """

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class Reads(abc.ABC):
    """Ranged reads in flight into the caller's buffers."""

    @abc.abstractmethod
    def ready(self, i: int, stop: int) -> None:
        """Returns once the first `stop` bytes of buffer `i` are read; raises
        what their read raised (`BadFile` if the file ends before them)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Returns once every buffer is filled; raises as `ready` does."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Abandons the reads not yet done (after an error); never raises."""


class InOrder(Reads):
    """Reads as jobs `(buffer, start in it, stop in it, ...)`, finished in
    order: a buffer's bytes are ready up to the stop of its last finished
    job. Subclasses start the jobs and say how to wait for the next one."""

    def __init__(self, jobs: Sequence[tuple], buffers: Sequence[np.ndarray]):
        self._jobs, self._buffers = jobs, buffers
        self._done = 0
        self._filled = [0] * len(buffers)

    @abc.abstractmethod
    def _finish_next(self) -> None:
        """Waits for job `self._done` (bounded), raising what it raised."""

    def _next(self) -> None:
        i, _, to, *_ = self._jobs[self._done]
        self._finish_next()
        self._filled[i] = to
        self._done += 1

    def ready(self, i: int, stop: int) -> None:
        while self._filled[i] < stop and self._done < len(self._jobs):
            self._next()

    def wait(self) -> None:
        try:
            while self._done < len(self._jobs):
                self._next()
        finally:
            self.cancel()


class Reader(abc.ABC):
    """One file opened for ranged reads, its length already checked."""

    @abc.abstractmethod
    def start(
        self, ranges: Sequence[tuple[int, int]], buffers: Sequence[np.ndarray]
    ) -> Reads:
        """Starts reading each byte range `[start, stop)` into its buffer."""

    def close(self) -> None:
        """Lets go of what the reader holds."""

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Store(abc.ABC):
    """Files of one kind of storage."""

    @abc.abstractmethod
    def read_whole(self, path: Any, limit: int, error: ErrorFor) -> bytes:
        """A whole file of at most `limit` bytes; more raises `error(...)`.

        `FileNotFoundError` if there is none, `PermissionError` as the store
        says.
        """

    @abc.abstractmethod
    def write_whole(self, path: Any, data: bytes) -> None:
        """Writes `data` as file `path`, whole or not at all, replacing it."""

    @abc.abstractmethod
    def write_new(self, path: Any, data: bytes) -> None:
        """Writes `data` as file `path`, whole, only if there is none there:
        `FileExistsError` if there is (another writer's file is left alone)."""

    @abc.abstractmethod
    def write_stream(self, path: Any, parts: Iterable[memoryview], nbytes: int) -> None:
        """Writes a new file of `nbytes` bytes given in order as `parts`,
        never holding more than a bounded window of it; durable on return."""

    @abc.abstractmethod
    def open(self, path: Any, end: int, nbytes: int | None) -> Reader:
        """Opens `path` for ranged reads up to byte `end`.

        Raises `BadFile` if it is missing, shorter than `end`, or longer than
        `nbytes` (the length recorded for it, if known): before the caller
        allocates anything for sizes that only a damaged record claims.
        """

    def check_reachable(self, path: Any) -> None:
        """Raises an error that says what to set if the store cannot be
        reached at `path` (credentials, endpoint); before Orbax's own
        directory calls, whose errors say less."""

    def wrap(
        self, error: BaseException, path: Any, what: str = "Saving to"
    ) -> BaseException:
        """`error`, raised by Orbax's own file calls at `path` (while `what`:
        "Saving to", "Reading"), worded as this store's errors are where that
        helps (see `objects`)."""
        return error

    @abc.abstractmethod
    def version(self, path: Any) -> Any:
        """Which file is at `path` now: a value that changes whenever it is
        written anew (on a disk its inode and change time, on an object store
        its generation), or None if there is none."""

    @abc.abstractmethod
    def exists(self, path: Any) -> bool:
        """Whether there is a file at `path` (stored whole or in parts)."""

    @abc.abstractmethod
    def delete(self, path: Any) -> None:
        """Removes file `path` and its parts, if there; no error if not."""
