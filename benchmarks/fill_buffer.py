"""Filling a restore's buffer from a file in the page cache, four ways, A/B.

    python benchmarks/fill_buffer.py [--mib 1024] [--rounds 6] [--fragment N]

A restore reads packed bytes into one anonymous mapping of 4 KiB pages, in
16 MiB pieces on four threads (`_storage/ranges.py: aligned_empty`), and a
cold restore of 3 GiB takes 786,432 page faults there, against 1,537 for a
raw read into `np.empty` (huge pages). This times, in one process, turn
about, the same file read into a fresh mapping:

- `plain`: as the restore does;
- `populate`: each piece's pages made first in one call
  (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14 on), then read;
- `huge`: the mapping marked `MADV_HUGEPAGE`, pages faulted by the reads;
- `hugepop`: marked, and each piece populated before its read.

`--fragment N` first allocates and touches N arrays of 1-3 MiB and frees
every other one, as a process that has worked has its memory: huge pages then
need compaction. The file is read once before, so the page cache holds it:
this measures the buffer, not the disk. Medians and every time, in seconds.
A measurement, never a test.
"""

import argparse
import concurrent.futures
import mmap
import os
import platform
import random
import statistics
import tempfile
import time

import numpy as np

PIECE = 16 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14 on


def _fill(fd: int, nbytes: int, mode: str) -> float:
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if mode in ("huge", "hugepop"):
        mapped.madvise(MADV_HUGEPAGE)
    took = _read(fd, mapped, nbytes, mode)
    mapped.close()
    return took


def _read(fd: int, mapped: mmap.mmap, nbytes: int, mode: str) -> float:
    buffer = np.frombuffer(mapped, np.uint8)

    def piece(offset: int) -> None:
        size = min(PIECE, nbytes - offset)
        if mode in ("populate", "hugepop"):
            mapped.madvise(MADV_POPULATE_WRITE, offset, size)
        os.preadv(fd, [memoryview(buffer[offset : offset + size])], offset)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(piece, range(0, nbytes, PIECE)))
    return time.perf_counter() - start


def main(mib: int, rounds: int, fragment: int) -> None:
    nbytes = mib << 20
    with tempfile.TemporaryDirectory() as where:
        path = os.path.join(where, "data.bin")
        with open(path, "wb") as f:
            for _ in range(0, nbytes, 64 << 20):
                f.write(os.urandom(64 << 20))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, nbytes, 0)  # into the page cache
            kept = [
                np.ones(random.randint(1, 3) << 20, np.uint8) for _ in range(fragment)
            ]
            del kept[::2]
            modes = ["plain", "populate", "huge", "hugepop"]
            times: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(rounds):
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    times[mode].append(_fill(fd, nbytes, mode))
        finally:
            os.close(fd)
    print(
        f"{mib} MiB from the page cache into a fresh mapping, 4 threads of 16 MiB "
        f"pieces; {fragment} arrays of 1-3 MiB made and half freed first; "
        f"{os.cpu_count()} CPUs, Linux {platform.release()}, medians of {rounds}"
    )
    for mode, took in times.items():
        every = " ".join(f"{t:.2f}" for t in took)
        print(f"  {mode:>8}: {statistics.median(took):.3f} s  ({every})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fragment", type=int, default=0)
    args = parser.parse_args()
    main(args.mib, args.rounds, args.fragment)
