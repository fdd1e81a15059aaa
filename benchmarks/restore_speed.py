"""`oeqx.restore` of a many-leaf model, A/B against a git revision, in one process.

    python benchmarks/restore_speed.py [--leaves 50000] [--rounds 7]
                                       [--base main] [--stages]

Saves the model of `per_leaf.py` (residual blocks of small float32 arrays,
one CPU device) with this checkout, then restores it into its
`filter_eval_shape`-like skeleton through each version's `restore`
(`block_until_ready` included), taking turns (A B, then B A, ...),
`gc.collect()` before each, page cache warm. The base is the package as
committed at `--base`, extracted with `git archive` and imported under another
name (as `inspect_speed.py` does). Both restores must give the same values.

With `--stages`, then, for this checkout only, where a restore's time goes:
each stage timed as the restore runs it (the collector paused, as a restore
pauses it), by wrapping the stage's function for the measurement.

Prints medians and bests in microseconds per leaf, with the configuration,
and the CPU time the process spent (all threads: less swayed than the wall
clock by other work on a shared machine).
Issue 30's target: restore <= 60 us a leaf, linear from 1k to 100k leaves.
The VM these numbers come from is shared: trust the ratio of one run more
than either figure. A measurement, never a test.
"""

import argparse
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from _base import checkout_head, import_base  # noqa: E402
from per_leaf import _saved  # noqa: E402
from short_records import _turns  # noqa: E402


def _base_restore(rev: str, into: Path):
    """`restore` of the package as committed at `rev` (see `_base.py`)."""
    return import_base(rev, into, "_orbax.api").restore


def _same(a, b) -> bool:
    import jax
    import numpy as np

    xs, ys = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(xs) == len(ys) and all(
        type(x) is type(y)
        and x.dtype == y.dtype
        and x.sharding == y.sharding
        and x.committed == y.committed
        and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(xs, ys, strict=True)
    )


def _stages(path: str, skeleton, rounds: int, n: int) -> None:
    """This checkout's restore, stage by stage (each stage's function wrapped)."""
    import gc

    import jax

    import orbax_eqx as oeqx
    from orbax_eqx._orbax import handler
    from orbax_eqx._restore import restore as rest
    from orbax_eqx._storage.packed import read as packed

    times: dict[str, list[float]] = {}

    def timed(module, name: str, what: str) -> None:
        f = getattr(module, name)

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                times.setdefault(what, []).append(time.perf_counter() - start)

        setattr(module, name, wrapper)

    timed(handler._sidecar_read, "read", "read the sidecar")
    timed(rest, "walk", "walk the skeleton")
    timed(rest, "select", "select")
    timed(rest, "check", "check")
    timed(rest, "resolve", "shardings")
    timed(rest, "read_arrays", "read_arrays")
    timed(packed, "_to_arrays", "  of which packed._to_arrays (device_put)")
    timed(rest.jtu, "tree_unflatten", "unflatten")
    total = []
    for _ in range(rounds):
        gc.collect()
        start = time.perf_counter()
        jax.block_until_ready(oeqx.restore(path, skeleton))
        total.append(time.perf_counter() - start)
    print("Where this checkout's restore goes (medians, us a leaf):")
    print(f"  {'whole restore':>42}: {statistics.median(total) / n * 1e6:.1f}")
    for what, t in times.items():
        print(f"  {what:>42}: {statistics.median(t) / n * 1e6:.1f}")


def main(n: int, rounds: int, base: str, stages: bool) -> None:
    import jax

    import orbax_eqx as oeqx

    workdir = Path(tempfile.mkdtemp())
    theirs = _base_restore(base, workdir / "base")
    path = str(workdir / "ckpt")
    skeleton, n = _saved(n, path)
    head = checkout_head()
    print(
        f"restore of {n} leaves into a skeleton; backend "
        f"{jax.default_backend()}, {jax.device_count()} device(s); "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}, jax "
        f"{jax.__version__}; page cache warm; medians of {rounds}, taking "
        "turns, one process"
    )

    def run(restore):
        jax.block_until_ready(restore(path, skeleton))

    runs = {
        f"base ({base})": functools.partial(run, theirs),
        f"this checkout ({head}+)": functools.partial(run, oeqx.restore),
    }
    same = _same(theirs(path, skeleton), oeqx.restore(path, skeleton))  # warm too
    print(f"  values restored: {'the same' if same else 'DIFFERENT'}")
    cpu: dict[str, list[float]] = {what: [] for what in runs}

    def on_cpu(what, run):
        start = time.process_time()
        run()
        cpu[what].append(time.process_time() - start)

    times = _turns(
        rounds,
        {what: functools.partial(on_cpu, what, run) for what, run in runs.items()},
    )
    for what, t in times.items():
        median, best = statistics.median(t) / n * 1e6, min(t) / n * 1e6
        on = statistics.median(cpu[what]) / n * 1e6
        print(
            f"  {what:>28}: {median:.1f} us a leaf (best {best:.1f}); "
            f"CPU time, all threads: {on:.1f}"
        )
    a, b = (statistics.median(t) for t in times.values())
    c, d = (statistics.median(t) for t in cpu.values())
    print(f"  this checkout / base: {b / a:.2f}x wall, {d / c:.2f}x CPU time")
    if stages:
        _stages(path, skeleton, rounds, n)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--base", default="main", help="git revision (default main)")
    parser.add_argument("--stages", action="store_true")
    options = parser.parse_args()
    main(options.leaves, options.rounds, options.base, options.stages)
