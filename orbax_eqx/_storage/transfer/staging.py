"""Staging: host bytes on their way to the devices, through a bounded window.

On CPU `jax.device_put` aliases a 64-byte-aligned buffer; elsewhere every
host buffer is a staging copy, and holding all of them would need host memory
for the whole checkpoint and more. So a copying restore reads in jobs within
a window, the next read while the devices take the last, and lets buffers go
once transferred. Buffers come from `Staging.empty` (numpy, which
`tracemalloc` traces: the tests hold its peak to the window). An explicit
`max_staged_bytes` makes buffers 16 bytes off alignment, so CPU devices copy
as accelerators do and the bounded path runs without one.
"""

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from ..._errors import OrbaxEqxError
from ..._format.sidecar import PACK_ALIGNMENT

# Jobs are at most this part of the bytes a restore reads (two are held at
# once: one being read, one being transferred)...
_SPLIT = 32
# ...but not smaller than this: each job costs a read call and a transfer call.
MIN_JOB = 1 << 20
# A streamed slab of a shard pack reads whole checksum blocks (up to 1 MiB each), up
# to two more than it needs: with less than 4 MiB a slab, most of what is read would be
# read again for the next one. Two such slabs (one read, one transferred).
MIN_WINDOW = 8 << 20
_OFF_ALIGNMENT = 16  # bytes off 64-byte alignment, staging on CPU devices


class StagingError(OrbaxEqxError, ValueError):
    """A staging option (`max_staged_bytes`) is invalid."""


def default_max_bytes() -> int:
    """The default window: the smaller of 1 GiB and a tenth of the RAM."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 30
    return max(MIN_WINDOW, min(1 << 30, ram // 10))


def check_max_bytes(value: Any) -> None:
    """Raises `StagingError` unless `value` is None or a window we can keep."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise StagingError(
            f"EqxRestore(max_staged_bytes={value!r}): expected a number of bytes "
            f"(an int, at least {MIN_WINDOW} = 8 MiB) or None for the default "
            "(the smaller of 1 GiB and a tenth of the RAM)."
        )
    if value < MIN_WINDOW:
        raise StagingError(
            f"EqxRestore(max_staged_bytes={value}): the window must hold at least "
            f"{MIN_WINDOW} bytes (8 MiB), found {value}: two jobs of a restore, "
            "each with whole 1 MiB blocks of a shard pack, must fit in it. Pass "
            f"max_staged_bytes={MIN_WINDOW} or more."
        )


class Staging:
    """One restore's window and where its buffers go."""

    def __init__(
        self, max_bytes: int | None, *, copy: bool, off_alignment: bool = False
    ):
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.copy = copy
        self._skew = _OFF_ALIGNMENT if off_alignment else 0

    def job_bytes(self, total: int) -> int:
        """The most bytes one job stages, for a restore that reads `total`."""
        return max(1, min(self.max_bytes // 2, max(MIN_JOB, total // _SPLIT)))

    def empty(self, nbytes: int) -> np.ndarray:
        """A new uint8 staging buffer (off alignment where CPUs must copy it)."""
        raw = np.empty(nbytes + 2 * PACK_ALIGNMENT, np.uint8)
        start = (-raw.ctypes.data) % PACK_ALIGNMENT + self._skew
        return raw[start : start + nbytes]

    def handoff(self, host: np.ndarray) -> np.ndarray:
        """`host`, or a copy of it where a CPU device would alias it (a view
        that happens to be 64-byte aligned, staging on CPU devices)."""
        if not self._skew or host.ctypes.data % PACK_ALIGNMENT:
            return host
        out = self.empty(host.nbytes).view(host.dtype).reshape(host.shape)
        out[...] = host
        return out

    def run(self, jobs: Iterable["Job"]) -> None:
        """Runs `jobs` in order: reads one in a thread while the caller starts
        the transfers of the one before and waits for them to be done."""
        todo = iter(jobs)
        job = next(todo, None)
        if job is None:
            return
        with concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="orbax_eqx-staging"
        ) as reader:
            pending = reader.submit(job.read)
            while job is not None:
                host = pending.result()
                # Starting these transfers also lets JAX drop what it still
                # held of the job before last, before the next read allocates.
                started = job.put(host)
                del host
                job = next(todo, None)
                if job is not None:
                    pending = reader.submit(job.read)
                jax.block_until_ready(started)
                del started


@dataclasses.dataclass
class Job:
    """One step of a staged restore."""

    read: Callable[[], Any]
    put: Callable[[Any], Any]


def for_restore(max_bytes: int | None, shardings: Sequence[Any]) -> Staging:
    """The staging of a restore onto `shardings` (None for numpy leaves)."""
    check_max_bytes(max_bytes)
    devices = {d for s in shardings if s is not None for d in _devices(s)}
    accelerated = any(d.platform != "cpu" for d in devices)
    copy = bool(devices) and (accelerated or max_bytes is not None)
    return Staging(max_bytes, copy=copy, off_alignment=copy and not accelerated)


_DEVICES: dict = {}


def _devices(sharding: Any) -> frozenset:
    found = _DEVICES.get(sharding)
    if found is None:
        found = frozenset(sharding.device_set)
        if len(_DEVICES) > 4096:
            _DEVICES.clear()
        _DEVICES[sharding] = found
    return found
