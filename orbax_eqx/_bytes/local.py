"""Local files: written with `pwritev` and renamed into place, read with `preadv`."""

import errno
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import files as _files
from . import store as _parts  # (how a large file is cut into objects)
from .store import BadFile, ErrorFor, Reader, Reads, Store, check_length

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
        # A new file of a random name, linked into place: unlike a rename,
        # the link fails if a file is there.
        text = os.fspath(path)
        fd, tmp = _files.create_new(text)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
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
        reader = _FileReader()
        try:
            try:
                check_length(reader.add(text), end, nbytes)
                return reader
            except FileNotFoundError:
                if nbytes is not None and not _parts.count(nbytes):
                    raise BadFile("is missing") from None
                if not os.path.lexists(_parts.part_name(text, 0)):
                    raise BadFile("is missing") from None
            total = end if nbytes is None else nbytes
            count = max(-(-total // _parts.PART_BYTES), 1)
            for k in range(count):  # each of PART_BYTES, the last of the rest
                try:
                    size = reader.add(_parts.part_name(text, k))
                except FileNotFoundError:
                    raise BadFile(f"is missing its part {k}") from None
                last = k == count - 1
                want = total - k * _parts.PART_BYTES if last else _parts.PART_BYTES
                exact = nbytes is not None or not last
                check_length(size, want, want if exact else None, f"a part {k} of ")
            return reader
        except BaseException:
            reader.close()
            raise

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

    def listing(self, directory: Any, depth: int) -> list[str]:
        top = os.fspath(directory)
        found: set[str] = set()

        def walk(at: str, left: int) -> None:
            try:
                entries = list(os.scandir(os.path.join(top, at) if at else top))
            except (NotADirectoryError, FileNotFoundError):
                return
            for entry in entries:
                name = f"{at}/{entry.name}" if at else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if left > 1:
                        walk(name, left - 1)
                elif entry.is_file(follow_symlinks=False):
                    found.add(_parts.whole_name(name))

        walk("", depth)
        return sorted(found)


def _identity(found: os.stat_result) -> tuple[int, int, int, int]:
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


class _FileReader(Reader):
    """Open descriptors of one file, or of its parts (`_parts.pieces`), each
    with the identity it had when opened."""

    def __init__(self) -> None:
        self._opened: list[tuple[str, int, tuple]] = []  # (path, fd, identity)

    def add(self, path: str) -> int:
        """Opens `path` (a part, if not the first); returns its size."""
        fd = _files.open_regular(path, BadFile)
        self._opened.append((path, fd, _identity(os.fstat(fd))))
        self.check_unchanged()  # the path still names what was opened
        return self._opened[-1][2][2]

    def check_unchanged(self) -> None:
        for path, fd, identity in self._opened:
            try:
                now = _identity(os.stat(path))
            except FileNotFoundError:
                raise BadFile("was deleted while it was read") from None
            if now != identity or _identity(os.fstat(fd)) != identity:
                raise BadFile(
                    f"was replaced or changed while it was read (device, inode, "
                    f"size, mtime {identity} when opened, {now} now)"
                )

    def identity(self) -> Any:
        return tuple(identity for _, _, identity in self._opened)

    def start(
        self, ranges: Sequence[tuple[int, int]], buffers: Sequence[np.ndarray]
    ) -> Reads:
        try:
            self.check_unchanged()
        except BadFile as e:
            return Reads([(0, 0, _raise(e))], 1)
        jobs = []
        whole = len(self._opened) == 1
        for i, ((start, stop), buf) in enumerate(zip(ranges, buffers, strict=True)):
            at = 0
            where = [(0, start, stop)] if whole else _parts.pieces(start, stop)
            for k, a, z in where:
                for piece in range(a, z, _PIECE):
                    n = min(_PIECE, z - piece)
                    view, fd = buf.data[at : at + n], self._opened[k][1]
                    jobs.append((i, at + n, _pread(fd, view, piece, start + at)))
                    at += n
        return Reads(jobs, _READERS)

    def close(self) -> None:
        for _, fd, _ in self._opened:
            os.close(fd)
        self._opened = []


def _raise(error: Exception):
    def job() -> None:
        raise error

    return job


def _pread(fd: int, view: memoryview, offset: int, at: int):
    """A job filling `view` from `offset` of `fd`; `at`: where it starts in
    the file as the caller sees it (for the message)."""

    def job() -> None:
        nonlocal view, offset
        end = at + view.nbytes
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise BadFile(f"ends before byte {end}")
            view, offset = view[n:], offset + n

    return job


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
