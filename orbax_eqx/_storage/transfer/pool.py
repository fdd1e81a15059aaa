"""Host buffers reused from one async save to the next, for numpy leaves' copies."""

import mmap
import threading
from typing import Any

import numpy as np

from ..._errors import OrbaxEqxError

MIN_BYTES = 1 << 20  # smaller copies are made fresh
MAX_IDLE = 8 << 30  # idle bytes kept at most, per pool
# Anonymous mappings rather than numpy's buffers: numpy asks for huge pages
# on large ones, which a busy process pays for by compacting memory (see
# `_storage/ranges.py: aligned_empty`); page-aligned, so 64-byte aligned.
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def _new_buffer(nbytes: int) -> np.ndarray:
    if _MAP_FLAGS:
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=_MAP_FLAGS), np.uint8)
    return np.empty(nbytes, np.uint8)  # (where mmap takes no flags: Windows)


class HostPoolError(OrbaxEqxError, ValueError):
    """`EqxHandler(kept_copy_bytes=...)` is not a number of bytes."""


def check_max_idle(value: Any) -> int:
    """`value`, if it is a number of bytes a pool may keep idle; else raises
    `HostPoolError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HostPoolError(
            f"EqxHandler(kept_copy_bytes={value!r}): expected a number of bytes "
            "(an int, 0 or more) of host memory to keep between async saves "
            "for copies of numpy leaves; found "
            f"{type(value).__name__} {value!r}. Pass kept_copy_bytes=0 to keep "
            f"none, or leave it out for the default ({MAX_IDLE} = 8 GiB)."
        )
    return value


class HostPool:
    """Idle host buffers, by size, shared by the saves of one handler."""

    def __init__(self, max_idle: int = MAX_IDLE):
        max_idle = check_max_idle(max_idle)
        self._lock = threading.Lock()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._max_idle = max_idle
        self._closed = False

    def lease(self) -> "Lease":
        """A new lease, for one save's copies."""
        return Lease(self)

    def idle_bytes(self) -> int:
        """Bytes of the idle buffers kept now."""
        with self._lock:
            return self._idle_bytes

    def close(self) -> None:
        """Lets go of every idle buffer; buffers given back later are let go too."""
        with self._lock:
            self._closed = True
            self._idle.clear()
            self._idle_bytes = 0

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._idle.get(nbytes)
            if free:
                buffer = free.pop()
                if not free:
                    del self._idle[nbytes]
                self._idle_bytes -= nbytes
                return buffer
        return _new_buffer(nbytes)

    def _drop_idle(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    def _give_back(self, buffers: list[np.ndarray]) -> None:
        with self._lock:
            if self._closed:
                return
            for buffer in buffers:
                if self._idle_bytes + buffer.nbytes <= self._max_idle:
                    self._idle.setdefault(buffer.nbytes, []).append(buffer)
                    self._idle_bytes += buffer.nbytes


class Lease:
    """The pooled buffers one save's copies are in, until it gives them back."""

    def __init__(self, pool: HostPool):
        self._pool = pool
        self._out: list[np.ndarray] = []
        self._lock = threading.Lock()

    def copy(self, x: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of numpy array `x`, in a pooled buffer if it is
        large (see `MIN_BYTES`)."""
        nbytes = x.nbytes
        if nbytes < MIN_BYTES:
            return np.array(x, order="C", copy=True)
        buffer = self._pool._take(nbytes)
        with self._lock:
            self._out.append(buffer)
        out = buffer.view(x.dtype).reshape(x.shape)
        np.copyto(out, x, casting="no")
        return out

    def done(self) -> None:
        """The save has taken its copies: idle buffers it did not reuse go."""
        self._pool._drop_idle()

    def give_back(self) -> None:
        """Gives the buffers back to the pool, for the next save. Only once
        nothing reads them any more: the write that reads them is over."""
        with self._lock:
            buffers, self._out = self._out, []
        self._pool._give_back(buffers)
