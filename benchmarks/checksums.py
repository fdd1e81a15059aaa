"""Checksum throughput on this machine: which algorithm runs at memory speed.

    python benchmarks/checksums.py [--mib 512] [--repeats 5] [--json FILE]

Times, over the same buffer of random bytes (in page-cache-free host memory,
touched once before timing so that no page fault is measured):

- `zlib.crc32` (CRC-32; what formats 1-5 record),
- CRC32C through `google_crc32c` (Apache-2.0; the C extension, hardware
  accelerated with SSE4.2 / ARMv8 CRC instructions; GCS uses this checksum).
  Its C function accepts only `bytes`, so it is timed twice: with each piece
  copied to `bytes` first (what summing an array would cost) and over
  ready-made `bytes`,
- CRC32C through `crc32c` (LGPL-2.1-or-later; hardware accelerated too),
- XXH3-64 through `xxhash` (BSD-2-Clause),
- `memcpy` of the same bytes (numpy `copyto` into a touched buffer): the
  memory's own speed, the baseline every checksum is held against,

each over the buffer in 4 MiB pieces, single-threaded, and then with two
threads each summing half of the pieces: if a function releases the GIL, two
threads run close to twice as fast on two free cores. The figures are medians
of `--repeats` passes; the machine is shared, so only ratios from one run
mean anything. A package that is not installed is reported as such.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import zlib

import numpy as np

MiB = 1 << 20
PIECE = 4 * MiB


def _algorithms():
    """name -> (function of (bytes-like, running value) -> value, initial)."""
    found = {"zlib.crc32": (lambda b, v: zlib.crc32(b, v), 0)}
    try:
        import google_crc32c

        impl = google_crc32c.implementation
        # Its C function takes only `bytes` (format "y#" refuses numpy's and
        # memoryview's buffers): timed as a user would have to call it, with
        # each piece copied to `bytes` first, and on ready-made `bytes`.
        found[f"google_crc32c ({impl}) + bytes()"] = (
            lambda b, v: google_crc32c.extend(v, bytes(b)),
            0,
        )
        found[f"google_crc32c ({impl}) on bytes"] = (
            lambda b, v: google_crc32c.extend(v, b),
            0,
        )
    except ImportError:
        print("google_crc32c: not installed")
    try:
        import crc32c

        found["crc32c"] = (lambda b, v: crc32c.crc32c(b, v), 0)
    except ImportError:
        print("crc32c: not installed")
    try:
        import xxhash

        def xxh3(b, v):
            # Each piece seeded with the previous piece's digest: a chain, so
            # the result depends on every piece and on their order.
            return xxhash.xxh3_64_intdigest(b, seed=v)

        found["xxhash.xxh3_64"] = (xxh3, 0)
    except ImportError:
        print("xxhash: not installed")
    return found


def _pieces(buf: np.ndarray) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i : i + PIECE] for i in range(0, len(view), PIECE)]


def _one_thread(fn, initial, pieces) -> float:
    start = time.perf_counter()
    value = initial
    for p in pieces:
        value = fn(p, value)
    return time.perf_counter() - start


def _two_threads(fn, initial, pieces) -> float:
    halves = [pieces[0::2], pieces[1::2]]
    results = [None, None]

    def work(i):
        value = initial
        for p in halves[i]:
            value = fn(p, value)
        results[i] = value

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def _memcpy(src: np.ndarray, dst: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("numpy", "google-crc32c", "crc32c", "xxhash"):
        try:
            parts.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            parts.append(f"{pkg} absent")
    return ", ".join(parts)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    print(
        f"Configuration: {args.mib} MiB buffer in {PIECE // MiB} MiB pieces, "
        f"medians of {args.repeats}; {os.cpu_count()} CPUs ({_cpu()}), load "
        f"average {os.getloadavg()[0]:.2f}; Python {sys.version.split()[0]}, "
        f"{_versions()}"
    )
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, args.mib * MiB, dtype=np.uint8)
    dst = np.ones_like(buf)  # touched: no page faults in the copy
    pieces = _pieces(buf)
    as_bytes = [bytes(p) for p in pieces]
    algos = _algorithms()

    times: dict[str, dict[str, list[float]]] = {"memcpy": {"1 thread": []}}
    for name in algos:
        times[name] = {"1 thread": [], "2 threads": []}
    for _ in range(args.repeats):  # interleaved: load swings hit all alike
        times["memcpy"]["1 thread"].append(_memcpy(buf, dst))
        for name, (fn, initial) in algos.items():
            ps = as_bytes if name.endswith(" on bytes") else pieces
            times[name]["1 thread"].append(_one_thread(fn, initial, ps))
            times[name]["2 threads"].append(_two_threads(fn, initial, ps))

    gb = args.mib * MiB / 1e9
    medians = {
        n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()
    }
    base = gb / medians["memcpy"]["1 thread"]
    zlib_speed = gb / medians["zlib.crc32"]["1 thread"]
    print(
        f"  {'algorithm':<28} {'1 thread GB/s':>14} {'2 threads GB/s':>15} "
        f"{'2t/1t':>6} {'/memcpy':>8} {'/zlib':>6}"
    )
    table = {}
    for name, med in medians.items():
        one = gb / med["1 thread"]
        two = gb / med["2 threads"] if "2 threads" in med else None
        table[name] = {"1 thread GB/s": one, "2 threads GB/s": two}
        two_text = f"{two:15.2f} {two / one:6.2f}" if two else f"{'-':>15} {'-':>6}"
        print(
            f"  {name:<28} {one:14.2f} {two_text} {one / base:8.2f} "
            f"{one / zlib_speed:6.2f}"
        )
    print(
        "  (2t/1t near 2.0: the function releases the GIL and two cores sum "
        "at once; near 1.0: it holds the GIL, or the other core is busy)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "mib": args.mib,
                    "repeats": args.repeats,
                    "table": table,
                    "versions": _versions(),
                    "cpu": _cpu(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
