"""The interface between what is stored and where its bytes go."""

import abc
import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

ErrorFor = Callable[[str], Exception]

PART_BYTES = 32 << 20
_PART = "{name}.part-{index:05d}"


def part_name(name: str, index: int) -> str:
    """The object holding bytes `[index * PART_BYTES, ...)` of file `name`."""
    return _PART.format(name=name, index=index)


def count(nbytes: int) -> int:
    """How many parts a file of `nbytes` bytes is stored in (0: one object)."""
    return 0 if nbytes <= PART_BYTES else -(-nbytes // PART_BYTES)


def pieces(start: int, stop: int) -> list[tuple[int, int, int]]:
    """Byte range `[start, stop)` of a file stored in parts, as
    `(part index, start in part, stop in part)`, in order."""
    out = []
    while start < stop:
        index, at = divmod(start, PART_BYTES)
        end = min(stop - start, PART_BYTES - at) + at
        out.append((index, at, end))
        start += end - at
    return out


class BadFile(Exception):
    """A file that is missing, of the wrong length, ends early, or was
    replaced while a `Reader` had it open."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class Reads:
    """Ranged reads in flight into the caller's buffers: `jobs` are `(buffer,
    its stop in the buffer, callable)`, in order of need, run by `workers`
    threads."""

    def __init__(self, jobs: Sequence[tuple[int, int, Callable[[], None]]], workers):
        self._pool = None
        if len(jobs) > 1:  # else read here: a thread costs more than a small read
            self._pool = concurrent.futures.ThreadPoolExecutor(min(workers, len(jobs)))
        self._jobs = [(i, stop, self._run(job)) for i, stop, job in jobs]

    def _run(self, job: Callable[[], None]) -> concurrent.futures.Future:
        if self._pool is not None:
            return self._pool.submit(job)
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            job()
            done.set_result(None)
        except Exception as e:  # raised by `ready` and `wait`, as from a thread
            done.set_exception(e)
        return done

    def ready(self, i: int, stop: int) -> None:
        """Returns once the first `stop` bytes of buffer `i` are read; raises
        what their read raised (`BadFile` if the file ends before them)."""
        before = 0
        for j, end, future in self._jobs:
            if j == i and before < stop:
                future.result()  # bounded: every request has a timeout
                before = end

    def wait(self) -> None:
        """Returns once every buffer is filled; raises as `ready` does."""
        try:
            for _, _, future in self._jobs:
                future.result()
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Abandons the reads not yet started (after an error); never raises."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class Reader(abc.ABC):
    """One file opened for ranged reads, its length already checked: every
    read comes from the very version of the file that `open` saw, or raises
    `BadFile("was replaced ...")`."""

    @abc.abstractmethod
    def start(
        self, ranges: Sequence[tuple[int, int]], buffers: Sequence[np.ndarray]
    ) -> Reads:
        """Starts reading each byte range `[start, stop)` into its buffer."""

    def check_unchanged(self) -> None:
        """Raises `BadFile("was replaced ...")` if the path names another file
        than the one opened (after the reads, for callers that must know)."""

    def identity(self) -> Any:
        """Which file was opened (on a disk its device, inode, size and
        modification time; on an object store its generations): equal for
        two readers of one version of a file."""
        return None

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
        """A whole file of at most `limit` bytes; more raises `error(...)`,
        none `FileNotFoundError`."""

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
        """Opens `path` for ranged reads up to byte `end`, pinned to the file
        that is there now. Raises `BadFile` if it is missing, shorter than
        `end`, or longer than `nbytes` (its recorded length, if known):
        before the caller allocates anything for sizes only damage claims."""

    def check_reachable(self, path: Any) -> None:
        """Raises an error that says what to set if the store cannot be
        reached at `path`: before Orbax's own calls, whose errors say less."""

    def wrap(
        self, error: BaseException, path: Any, what: str = "Saving to"
    ) -> BaseException:
        """`error`, raised by Orbax's own file calls at `path` (while `what`),
        as this store's error where that helps (see `objects`)."""
        return error

    @abc.abstractmethod
    def version(self, path: Any) -> Any:
        """Which file is at `path` now: a value that changes whenever it is
        written anew (on a disk its inode and change time, on an object store
        its generation or ETag), or None if there is none."""

    @abc.abstractmethod
    def exists(self, path: Any) -> bool:
        """Whether there is a file at `path` (stored whole or in parts)."""

    @abc.abstractmethod
    def delete(self, path: Any) -> None:
        """Removes file `path` and its parts, if there; no error if not."""

    @abc.abstractmethod
    def listing(self, directory: Any, depth: int) -> list[str]:
        """The files under `directory` at most `depth` levels down, as paths
        relative to it (`a/b`), each file stored in parts named once; none
        if there is no such directory."""


def whole_name(name: str) -> str:
    """The file a listed object is (part) of: `x.bin` for `x.bin.part-00003`."""
    head, mark, index = name.rpartition(".part-")
    return head if mark and len(index) == 5 and index.isdigit() else name


def check_length(size: int, end: int, nbytes: int | None, part: str = "") -> None:
    """A file (or `part`, "a part 3 of ") of `size` bytes holding ranges up
    to `end`, recorded as `nbytes` long: longer or shorter is damage."""
    if (nbytes is not None and size > nbytes) or size < end:
        written = end if nbytes is None else nbytes
        raise BadFile(f"has {part}{size} bytes where {written} were written")
