"""Ranged reads of objects through TensorStore, into the caller's buffers.

Reads go out as pieces of at most `_READ_PIECE` bytes, `_READ_WINDOW` in
flight, each copied into the caller's buffer by a helper thread as it
arrives; on S3, with botocore installed, as whole parts streamed straight
into the buffers instead (`s3_reads`). A piece whose read went wrong is
judged by `verdict` (read again, or the file's damage, or the store's
failure). An endpoint that ignores `Range:` answers 200 with the whole
object, which TensorStore refuses (`RANGE_IGNORED`): the piece is then taken
from the whole object at its offset, never other bytes.
"""

import collections
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import parts as _parts
from . import s3_reads as _s3_reads
from . import tries as _tries
from .store import BadFile, InOrder, Reader, Reads

# 8 MiB pieces, 4 in flight (measured on model (a), moto_server and
# fake-gcs-server, BENCHMARKS.md): as fast as whole-object downloads, with a
# restore's peak memory 1.2-1.25x the model's bytes. 4 MiB pieces doubled the
# requests and, on stores that read a whole part per ranged request (moto),
# the restore's time; 16 MiB or more in flight went past 1.3x.
_READ_PIECE = 8 << 20
_READ_WINDOW = 4
_COPIERS = 2  # threads copying arrived pieces into the buffers
# What TensorStore says of an answer with the whole object to a ranged read.
RANGE_IGNORED = "was ignored by server"


class ObjectReader(Reader):
    """One object (or file of parts) of `store`, opened for ranged reads."""

    def __init__(self, store: Any, path: Any, key: str, parts: bool):
        self._store, self._path, self._key, self._parts = store, path, key, parts

    def _where(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        if not self._parts:
            return [(self._key, start, stop)]
        return [
            (_parts.part_name(self._key, k), a, z)
            for k, a, z in _parts.pieces(start, stop)
        ]

    def start(
        self, ranges: Sequence[tuple[int, int]], buffers: Sequence[np.ndarray]
    ) -> Reads:
        streamed = self._store.where.scheme == "s3" and _s3_reads.available()
        size = _s3_reads.PIECE if streamed else _READ_PIECE
        jobs = []  # (buffer, its start, its stop, key, start, stop, file end)
        for i, ((start, stop), buf) in enumerate(zip(ranges, buffers, strict=True)):
            at = 0
            for key, a, z in self._where(start, stop):
                for piece in range(a, z, size):
                    n = min(size, z - piece)
                    jobs.append((i, at, at + n, key, piece, piece + n, start + at + n))
                    at += n
        if streamed:
            return _s3_reads.S3Reads(self._store, self._path, jobs, buffers)
        return _ObjectReads(self._store, self._path, jobs, buffers)


class _ObjectReads(InOrder):
    """Pieces read in order, at most `_READ_WINDOW` in flight; each copied
    into its buffer by a helper thread as it arrives, so that the copies (and
    first touches of the buffers' pages) overlap the caller's checks."""

    def __init__(self, store: Any, path: Any, jobs, buffers):
        super().__init__(jobs, buffers)
        self._store, self._path = store, path
        self._flight: collections.deque = collections.deque()  # (request, copy)
        self._issued = 0
        self._stop = threading.Event()
        self._copiers = concurrent.futures.ThreadPoolExecutor(_COPIERS)
        self._issue()

    def _issue(self) -> None:
        kv = self._store._kv
        while self._issued < len(self._jobs) and len(self._flight) < _READ_WINDOW:
            job = self._jobs[self._issued]
            request = kv.read(job[3], byte_range=slice(job[4], job[5]))
            self._flight.append(
                (request, self._copiers.submit(self._fill, request, job))
            )
            self._issued += 1

    def _fill(self, request: Any, job) -> None:
        i, at, to, key, a, z, end = job
        store, path = self._store, self._path
        first = [request]

        def once() -> bytes:
            try:
                if first:
                    try:
                        got = store._result(first.pop(), "Reading", path)
                    except ValueError as e:
                        if RANGE_IGNORED not in str(e):
                            raise
                        got = store._from_whole(key, path, slice(a, z))
                else:  # tried again
                    got = store._read(key, path, slice(a, z))
            except ValueError as e:  # OUT_OF_RANGE: fewer bytes, or others
                raise _tries.Retry(
                    f"a read of bytes {a}-{z} of {key} was answered out of range "
                    f"({str(e).splitlines()[0]})",
                    short=True,
                ) from None
            if got.state == "missing":
                raise BadFile("is missing")
            if len(got.value) != z - a:
                raise _tries.Retry(
                    f"{len(got.value)} bytes answered to a read of bytes "
                    f"{a}-{z} of {key}",
                    short=True,
                )
            return got.value

        value = _tries.ranged(
            once,
            lambda: store.holds(key, path, z),
            lambda detail: store._failed("Reading", path, detail),
            end,
            self._stop.is_set,
        )
        if value is not None:
            self._buffers[i][at:to] = np.frombuffer(value, np.uint8)

    def _finish_next(self) -> None:
        _, copy = self._flight.popleft()
        copy.result()
        self._issue()

    def cancel(self) -> None:
        self._stop.set()
        for request, copy in self._flight:
            request.cancel()
            copy.cancel()
        self._flight.clear()
        self._copiers.shutdown(wait=True)
