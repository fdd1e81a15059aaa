"""Local files: written with `pwritev` and renamed into place, read with `preadv`.

Writing is batched `pwritev` into a new file beside the target (`files.
create_new`: never through a link planted at the name), one fsync, and a
rename. Reading fills the caller's buffers with `preadv`, a few pieces at
once in threads (a virtual disk serves parallel reads faster than one
stream). Only regular files are read (`files.open_regular`: a FIFO would
block a plain read forever). A file stored in parts (copied down from an
object store, see `parts`) reads as the file it was.
"""

import concurrent.futures
import errno
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import files as _files
from . import parts as _parts
from .store import BadFile, ErrorFor, Reader, Reads, Store

_PIECE = 16 << 20  # bytes per read call; a few are in flight at once
_WRITE_BATCH = 64 << 20  # bytes per write call
_IOV_MAX = 512  # buffers per write call (Linux allows 1024)
_READERS = 4


class LocalStore(Store):
    def read_whole(self, path: Any, limit: int, error: ErrorFor) -> bytes:
        return _files.read_bounded(path, limit, error)

    def write_whole(self, path: Any, data: bytes) -> None:
        _files.replace_whole(path, data)

    def write_new(self, path: Any, data: bytes) -> None:
        # A new file of a random name (never through a link planted at a
        # predictable one), linked into place: unlike a rename, the link
        # fails if a file is there.
        text = os.fspath(path)
        fd, tmp = _files.create_new(text)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        try:
            os.link(tmp, text)
        except FileExistsError:
            if os.path.isdir(text):  # not another writer's file: something odd
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), text)
            raise
        finally:
            os.unlink(tmp)
        fd = os.open(os.path.dirname(text) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_stream(self, path: Any, parts: Iterable[memoryview], nbytes: int) -> None:
        fd, tmp = _files.create_new(path)
        try:
            try:
                offset, batch, size = 0, [], 0
                for part in parts:
                    batch.append(part)
                    size += part.nbytes
                    if len(batch) >= _IOV_MAX or size >= _WRITE_BATCH:
                        offset += _pwritev_all(fd, batch, offset)
                        batch, size = [], 0
                if batch:
                    _pwritev_all(fd, batch, offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, os.fspath(path))
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)

    def open(self, path: Any, end: int, nbytes: int | None) -> Reader:
        text = os.fspath(path)
        try:
            fd = _files.open_regular(text, BadFile)
        except FileNotFoundError:
            if nbytes is not None and not _parts.count(nbytes):
                raise BadFile("is missing") from None
            if not os.path.lexists(_parts.part_name(text, 0)):
                raise BadFile("is missing") from None
            return _PartsReader(text, end, nbytes)
        try:
            _check_length(os.fstat(fd).st_size, end, nbytes)
        except BaseException:
            os.close(fd)
            raise
        return _FileReader([fd], [None])

    def version(self, path: Any) -> Any:
        try:
            found = os.stat(path)
        except OSError:  # missing, or its directory is
            return None
        return (found.st_dev, found.st_ino, found.st_ctime_ns)

    def exists(self, path: Any) -> bool:
        return os.path.lexists(os.fspath(path))

    def delete(self, path: Any) -> None:
        name = os.fspath(path)
        directory, base = os.path.split(name)
        prefix = _parts.part_name(base, 0)[: -len("00000")]
        try:
            others = [n for n in os.listdir(directory or ".") if n.startswith(prefix)]
        except OSError:
            others = []
        for victim in [name, *(os.path.join(directory, n) for n in others)]:
            try:
                os.unlink(victim)
            except FileNotFoundError:
                pass


def _check_length(size: int, end: int, nbytes: int | None) -> None:
    """A file of `size` bytes holding ranges up to `end`, recorded as `nbytes`
    long: longer than recorded, or too short for the ranges, is damaged."""
    if (nbytes is not None and size > nbytes) or size < end:
        written = end if nbytes is None else nbytes
        raise BadFile(f"has {size} bytes where {written} were written")


class _FileReader(Reader):
    """Reads from open descriptors: one for a whole file, or one per part
    (`spans[k]`: part `k`'s place, None for a whole file)."""

    def __init__(self, fds: list[int], spans: list[Any]):
        self._fds = fds
        self._whole = spans == [None]

    def _where(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        if self._whole:
            return [(0, start, stop)]
        return _parts.pieces(start, stop)

    def start(
        self, ranges: Sequence[tuple[int, int]], buffers: Sequence[np.ndarray]
    ) -> Reads:
        jobs = []  # (buffer, view, descriptor, offset in it), in file order
        for i, ((start, stop), buf) in enumerate(zip(ranges, buffers, strict=True)):
            at = 0
            for k, a, z in self._where(start, stop):
                for piece in range(a, z, _PIECE):
                    n = min(_PIECE, z - piece)
                    view = buf.data[at : at + n]
                    jobs.append((i, view, self._fds[k], piece, start + at))
                    at += n
        return _LocalReads(jobs, len(buffers))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class _PartsReader(_FileReader):
    """A file stored in parts (see `parts`): each part a regular file of
    `PART_BYTES`, the last of the rest; without a recorded length, the parts
    that hold bytes up to `end`."""

    def __init__(self, name: str, end: int, nbytes: int | None):
        total = end if nbytes is None else nbytes
        count = max(-(-total // _parts.PART_BYTES), 1)
        fds = []
        try:
            for k in range(count):
                try:
                    fd = _files.open_regular(_parts.part_name(name, k), BadFile)
                except FileNotFoundError:
                    raise BadFile(f"is missing its part {k}") from None
                fds.append(fd)
                size = os.fstat(fd).st_size
                last = k == count - 1
                want = total - k * _parts.PART_BYTES if last else _parts.PART_BYTES
                if size < want or (size > want and (nbytes is not None or not last)):
                    raise BadFile(
                        f"has a part {k} of {size} bytes where {want} were written"
                    )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        super().__init__(fds, list(range(len(fds))))


class _LocalReads(Reads):
    def __init__(self, jobs, count: int):
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs = jobs
        self._pieces: list[list[Any]] | None = None
        if len(jobs) <= 1:
            for _, view, fd, offset, at in jobs:
                _pread_exactly(fd, view, offset, at)
            return
        self._pool = concurrent.futures.ThreadPoolExecutor(_READERS)
        self._pieces = [[] for _ in range(count)]
        self._ends: list[list[int]] = [[] for _ in range(count)]
        for i, view, fd, offset, at in jobs:  # in file order
            self._pieces[i].append(
                self._pool.submit(_pread_exactly, fd, view, offset, at)
            )
        self._seen = [0] * count
        # Each piece's end within its buffer, to know which cover `stop`.
        for i, view, _, _, _ in jobs:
            done = self._ends[i][-1] if self._ends[i] else 0
            self._ends[i].append(done + view.nbytes)

    def ready(self, i: int, stop: int) -> None:
        if self._pieces is None:
            return
        pieces, ends = self._pieces[i], self._ends[i]
        while self._seen[i] < len(pieces) and (
            self._seen[i] == 0 or ends[self._seen[i] - 1] < stop
        ):
            pieces[self._seen[i]].result()
            self._seen[i] += 1

    def wait(self) -> None:
        try:
            if self._pieces is not None:
                for piece in (p for ps in self._pieces for p in ps):
                    piece.result()
        finally:
            self.cancel()

    def cancel(self) -> None:
        if self._pool is not None:
            for piece in (p for ps in self._pieces or () for p in ps):
                piece.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


def _pread_exactly(fd: int, view: memoryview, offset: int, at: int) -> None:
    """Fills `view` from `offset` of `fd`; `at`: where it starts in the file
    as the caller sees it (for the message)."""
    end = at + view.nbytes
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise BadFile(f"ends before byte {end}")
        view, offset = view[n:], offset + n


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> int:
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        n = os.pwritev(fd, views, offset + done)
        done += n
        # A short write (a signal, a full disk's last bytes): skip what went out.
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]
    return total


STORE = LocalStore()
