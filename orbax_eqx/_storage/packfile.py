"""Pack files: byte ranges of one file, written and read at disk speed.

Writing is `pwritev` of host arrays at their offsets (zero bytes in between)
and one fsync. Reading fills 64-byte-aligned buffers with `preadv`, a few
pieces at once in threads (a virtual disk serves parallel reads faster than
one stream), so that `jax.device_put` takes the buffers as they are on CPU and
a restore holds each byte once. Paths that are not local files (`gs://...`)
go through `epath`, one range at a time.

A pack is read only if it is a regular file (see `files`: a FIFO there would
block a plain read forever, a directory reads as 4096 bytes of nothing) no
longer than its sidecar records, and only the byte ranges asked for.
"""

import concurrent.futures
import os
from collections.abc import Callable, Sequence

import numpy as np
from etils import epath

from .._errors import CheckpointDamagedError, permission_denied
from .._format.sidecar import PACK_ALIGNMENT as ALIGNMENT
from . import files as _files

_PIECE = 16 << 20  # bytes per read call; a few are in flight at once
_WRITE_BATCH = 64 << 20  # bytes per write call
_IOV_MAX = 512  # buffers per write call (Linux allows 1024)
_READERS = 4
_ZEROS = np.zeros(ALIGNMENT, np.uint8)


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer whose first byte is 64-byte aligned."""
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes]


def _is_local(path: epath.Path) -> bool:
    return not _files.is_remote(path)


def _as_bytes(x: np.ndarray) -> memoryview:
    # Through uint8, because the buffer protocol knows neither bfloat16 nor int4.
    return memoryview(x.reshape(-1).view(np.uint8))


def _gaps_and_arrays(pieces, nbytes):
    """The file's contents in order: each array's bytes, zeros between them."""
    cursor = 0
    for offset, x in pieces:
        if offset > cursor:
            gap = offset - cursor
            yield memoryview(_ZEROS[:gap] if gap <= ALIGNMENT else np.zeros(gap, "u1"))
        view = _as_bytes(x)
        yield view
        cursor = offset + view.nbytes
    if nbytes > cursor:
        yield memoryview(np.zeros(nbytes - cursor, np.uint8))


def write(
    path: epath.Path, pieces: Sequence[tuple[int, np.ndarray]], nbytes: int
) -> None:
    """Writes a new file of `nbytes` bytes holding each array at its offset.

    `pieces` are `(offset, C-contiguous array)`, in increasing offset order
    and not overlapping. The file is fsync'd before this returns. A local file
    is written under a new name beside `path` and renamed onto it.
    """
    parts = _gaps_and_arrays(pieces, nbytes)
    if not _is_local(path):
        with path.open("wb") as f:
            for part in parts:
                f.write(part)
        return
    # Never through a link or into a file already there: a new file beside
    # it (`files.create_new`), renamed onto the name once written. Whatever is
    # at the name (a link planted there) is replaced, never written through.
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


def read(
    path: epath.Path,
    ranges: Sequence[tuple[int, int]],
    *,
    meanwhile: Callable[[list[np.ndarray], Callable[[int, int], None]], None]
    | None = None,
    nbytes: int | None = None,
    empty: Callable[[int], np.ndarray] = aligned_empty,
) -> list[np.ndarray]:
    """Reads each byte range `[start, stop)` of `path` into its own aligned buffer.

    `meanwhile(buffers, ready)`, if given, runs in this thread while the reads
    are in flight (to check bytes as they arrive): `ready(i, stop)` returns
    once the first `stop` bytes of `buffers[i]` are read, and raises what
    their read raised. `nbytes`: the size the sidecar records for the file.
    A file longer than that is damaged; one too short for the ranges is
    damaged (ranges it still holds are read: what was written before a cut
    can be saved). A path that is not a regular file is damaged too.
    `empty(nbytes)` makes the buffers (a staging window's, to count them; see
    `staging`).
    """
    end = max((stop for _, stop in ranges), default=0)
    if not _is_local(path):
        _check_remote_size(path, end, nbytes)
        buffers = [empty(stop - start) for start, stop in ranges]
        _read_remote(path, ranges, buffers)
        if meanwhile is not None:
            meanwhile(buffers, _all_ready)
        return buffers
    try:
        fd = _files.open_regular(path, lambda what: _damaged(path, what))
    except FileNotFoundError:
        raise _damaged(path, "is missing") from None
    except PermissionError:
        raise permission_denied(path) from None
    try:
        # Before allocating: a sidecar claiming absurd sizes must not get to
        # ask for terabytes of memory.
        _check_length(path, os.fstat(fd).st_size, end, nbytes)
        buffers = [empty(stop - start) for start, stop in ranges]
        jobs = [
            (i, memoryview(buf)[at : at + _PIECE], start + at)
            for i, ((start, _), buf) in enumerate(zip(ranges, buffers))
            for at in range(0, buf.nbytes, _PIECE)
        ]
        if len(jobs) <= 1:
            for _, view, offset in jobs:
                _pread_exactly(fd, view, offset, path)
            if meanwhile is not None:
                meanwhile(buffers, _all_ready)
        else:
            with concurrent.futures.ThreadPoolExecutor(_READERS) as pool:
                pieces: list[list[concurrent.futures.Future]] = [[] for _ in buffers]
                for i, view, at in jobs:  # in file order
                    pieces[i].append(pool.submit(_pread_exactly, fd, view, at, path))
                try:
                    if meanwhile is not None:
                        seen = [0] * len(buffers)  # pieces known to be read

                        def ready(i: int, stop: int) -> None:
                            while seen[i] < -(-stop // _PIECE):
                                pieces[i][seen[i]].result()
                                seen[i] += 1

                        meanwhile(buffers, ready)
                    for piece in (p for ps in pieces for p in ps):
                        piece.result()
                finally:
                    for piece in (p for ps in pieces for p in ps):
                        piece.cancel()  # after an error: the rest is not wanted
    finally:
        os.close(fd)
    return buffers


def check_size(path: epath.Path, end: int, nbytes: int | None = None) -> None:
    """Raises `CheckpointDamagedError` unless `path` is a regular file of at
    least `end` bytes and at most `nbytes` (the size the sidecar records, if
    given), as `read` does: before a read is planned or allocated for sizes
    that only a damaged sidecar claims."""
    if not _is_local(path):
        return  # checked as `read` reads
    try:
        fd = _files.open_regular(path, lambda what: _damaged(path, what))
    except FileNotFoundError:
        raise _damaged(path, "is missing") from None
    except PermissionError:
        raise permission_denied(path) from None
    try:
        _check_length(path, os.fstat(fd).st_size, end, nbytes)
    finally:
        os.close(fd)


def _check_length(path, size: int, end: int, nbytes: int | None) -> None:
    """A file of `size` bytes holding ranges up to `end`, recorded as `nbytes`
    long: longer than recorded, or too short for the ranges, is damaged."""
    if (nbytes is not None and size > nbytes) or size < end:
        written = end if nbytes is None else nbytes
        raise _damaged(path, f"has {size} bytes where {written} were written")


def _all_ready(i: int, stop: int) -> None:
    """`ready` for reads that are all done."""


def _pread_exactly(fd: int, view: memoryview, offset: int, path) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise _damaged(path, f"ends before byte {offset + view.nbytes}")
        view, offset = view[n:], offset + n


def _check_remote_size(path, end: int, nbytes: int | None) -> None:
    if not path.exists():
        raise _damaged(path, "is missing")
    _check_length(path, path.stat().length, end, nbytes)


def _read_remote(path, ranges, buffers) -> None:
    with path.open("rb") as f:
        for (start, stop), buf in zip(ranges, buffers):
            f.seek(start)
            data = f.read(stop - start)
            if len(data) != stop - start:
                raise _damaged(path, f"ends before byte {stop}")
            buf[:] = np.frombuffer(data, np.uint8)


def _damaged(path, what: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The pack file {path} {what}: the checkpoint is damaged (a copy cut "
        "short, or a file deleted). Restore an earlier step, or re-save it."
    )
