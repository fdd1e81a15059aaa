"""A big model against the raw disk: save with checksums, cold restore, and why.

    python benchmarks/cold_io.py [--gib 3] [--repeats 3] [--dir DIR]

A dict of float32 arrays of 64 MiB each, `--gib` GiB in all, on one CPU
device. Each repeat, in turns:

- save: `oeqx.save` with checksums (the default) and without
  (`checksums=False`), against a raw `pwritev` of the same bytes + fsync;
- cold restore (the files dropped from the page cache with
  `posix_fadvise(DONTNEED)` first): `oeqx.restore` verifying the checksums
  (the default) and not (`verify=False`), against a raw cold read of the
  file with `preadv` in 64 MiB pieces, one thread, into one buffer, made two
  ways: numpy's `np.empty` (which asks the kernel for huge pages) and an
  anonymous mapping of 4 KiB pages (what orbax_eqx reads into).

Beside each time: the read system calls made (`syscr` of `/proc/self/io`),
the bytes read (`rchar`) and the minor page faults taken (`ru_minflt`)
during it, so that where the time goes can be told from the counts. Ratios
are of medians from the same run; issue 30's targets: save >= 0.9x the raw
write's throughput, cold restore <= 1.1x the raw cold read, checks on.
"""

import argparse
import mmap
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _contenders import evict  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

PIECE = 64 << 20


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        counts = dict(line.split(": ") for line in f.read().splitlines())
    counts = {k: int(v) for k, v in counts.items()}
    counts["minflt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return counts


def _raw_write(path, arrays) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for x in arrays:
            view = memoryview(np.asarray(x).reshape(-1).view(np.uint8))
            while view.nbytes:
                n = os.pwritev(fd, [view], offset)
                view, offset = view[n:], offset + n
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(path, mapped: bool) -> np.ndarray:
    size = os.path.getsize(path)
    if mapped:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        buf = np.frombuffer(mmap.mmap(-1, size, flags=flags), np.uint8)
    else:
        raw = np.empty(size + 64, np.uint8)
        start = (-raw.ctypes.data) % 64
        buf = raw[start : start + size]
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, size, PIECE):
            os.preadv(fd, [view[start : start + PIECE]], start)
    finally:
        os.close(fd)
    return buf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir")
    args = parser.parse_args()
    from importlib.metadata import version

    count = max(1, round(args.gib * 16))
    print(
        f"Configuration: backend CPU, 1 device, unsharded; {count} float32 "
        f"arrays of 64 MiB ({count / 16:.2f} GiB); cold page cache for reads; "
        f"medians of {args.repeats}; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}; Python {sys.version.split()[0]}, jax "
        f"{jax.__version__}, orbax-checkpoint {version('orbax-checkpoint')}; "
        f"THP {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}"
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
        else ""
    )
    rng = np.random.default_rng(0)
    item = {
        f"w{i:03d}": jnp.asarray(rng.standard_normal(16 << 20, np.float32))
        for i in range(count)
    }
    nbytes = sum(x.nbytes for x in item.values())
    skeleton = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), item
    )
    work = tempfile.mkdtemp(dir=args.dir)
    times: dict[str, list[float]] = {}
    counts: dict[str, dict[str, int]] = {}

    def timed(name, fn):
        before = _io()
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.setdefault(name, []).append(time.perf_counter() - start)
        after = _io()
        counts[name] = {k: after[k] - before[k] for k in ("syscr", "rchar", "minflt")}
        del out

    try:
        # The first few GiB written in a process cost several times the later
        # ones, whichever writer it is (`benchmarks/write_order.py`): one
        # untimed write of the same bytes first, so no contender carries it.
        warm = os.path.join(work, "warm-up")
        _raw_write(warm, item.values())
        os.remove(warm)
        for r in range(args.repeats):
            ck, nosum, raw = (os.path.join(work, f"{k}{r}") for k in "cnr")
            saves = [
                ("save oeqx", lambda: oeqx.save(ck, item)),
                (
                    "save oeqx checksums=False",
                    lambda: oeqx.save(nosum, item, checksums=False),
                ),
                ("raw write + fsync", lambda: _raw_write(raw, item.values())),
            ]
            for name, fn in saves[r % 3 :] + saves[: r % 3]:
                timed(name, fn)
            reads = [
                ("restore oeqx", lambda: oeqx.restore(ck, skeleton)),
                (
                    "restore oeqx verify=False",
                    lambda: oeqx.restore(ck, skeleton, verify=False),
                ),
                ("raw read, numpy buffer", lambda: _raw_read(raw, False)),
                ("raw read, mapped buffer", lambda: _raw_read(raw, True)),
            ]
            for name, fn in reads[r % 4 :] + reads[: r % 4]:
                for p in (ck, raw):
                    evict(p)
                timed(name, fn)
            for p in (ck, nosum):
                shutil.rmtree(p)
            os.remove(raw)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    for name, t in med.items():
        c = counts[name]
        print(
            f"  {name:<28} {t:7.3f} s {gb / t:6.2f} GB/s  read calls "
            f"{c['syscr']:>6}  read MiB {c['rchar'] >> 20:>6}  minor faults "
            f"{c['minflt']:>8}"
        )
    checks = [
        (
            "save throughput / raw write + fsync",
            med["raw write + fsync"] / med["save oeqx"],
            ">=",
            0.9,
        ),
        (
            "save checksums=False / raw",
            med["raw write + fsync"] / med["save oeqx checksums=False"],
            ">=",
            0.9,
        ),
        (
            "cold restore / raw read (numpy buffer)",
            med["restore oeqx"] / med["raw read, numpy buffer"],
            "<=",
            1.1,
        ),
        (
            "cold restore / raw read (mapped buffer)",
            med["restore oeqx"] / med["raw read, mapped buffer"],
            "<=",
            1.1,
        ),
        (
            "cold restore verify=False / raw read (numpy buffer)",
            med["restore oeqx verify=False"] / med["raw read, numpy buffer"],
            "<=",
            1.1,
        ),
    ]
    for name, value, op, goal in checks:
        ok = value >= goal if op == ">=" else value <= goal
        print(
            f"  [{'PASS' if ok else 'FAIL'}] {name}: {value:.2f}x (target {op} {goal}x)"
        )


if __name__ == "__main__":
    main()
