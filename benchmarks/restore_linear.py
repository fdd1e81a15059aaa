"""How a restore's cost a leaf grows from 1k to 100k leaves, in one process.

    python benchmarks/restore_linear.py [--leaves 1000,10000,100000] [--rounds 7]

`per_leaf.py` measures each leaf count in a fresh process, one after the
other; on the shared 2-core VM the machine's speed drifts between them (the
same 1k restore took 66 and 113 us a leaf an hour apart), which a ratio of
two such figures carries. Here one process saves the model of `per_leaf.py`
at every leaf count, then restores them in turns (1k, 10k, 100k, then
backwards, ...; `gc.collect()` before each, page cache warm, into the
`filter_eval_shape`-like skeleton, `block_until_ready` included), so each
count sees the same machine and the same heap. A smaller count is restored
several times a round (up to 20, as many as make the largest count's
leaves): one restore of 1k leaves takes a twentieth of a second, and a
hiccup of the machine's weighs on it a hundred times more than on 100k.
Beside the wall clock: the time Python's cyclic collector ran inside each
restore (`gc.callbacks`).

With `--natural`, no `gc.collect()` between restores: the collector runs
when Python's thresholds say, as in a program that restores again and again,
each count's figure is its mean (all its restores' time over all their
leaves), and the passes over the oldest generation (the whole heap) inside
each count's restores are counted. It tells whether the untimed
`gc.collect()` before each restore hides a share of those passes that the
small counts would otherwise pay (it does not: 0 passes in 140 restores of
1k leaves, 7 in 7 of 100k; a small restore's objects die young).

The target: the cost a leaf at the largest count <= 1.2x the
smallest's (medians; means with `--natural`). Prints the configuration,
PASS or FAIL; never a test.
"""

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from per_leaf import _Collections, _saved  # noqa: E402


def main(counts: list[int], rounds: int, natural: bool) -> None:
    import jax

    import orbax_eqx as oeqx

    work = Path(tempfile.mkdtemp())
    cases = {}
    for n in counts:
        path = str(work / f"n{n}")
        skeleton, leaves = _saved(n, path)
        jax.block_until_ready(oeqx.restore(path, skeleton))  # warm
        cases[leaves] = (path, skeleton)
    print(
        f"restore, {'/'.join(str(n) for n in cases)} leaves in turns, one "
        f"process; backend {jax.default_backend()}, {jax.device_count()} "
        f"device(s), unsharded; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}; Python {platform.python_version()}, jax "
        f"{jax.__version__}; page cache warm; {rounds} rounds, "
        + (
            "the collector left to its thresholds, means of every restore"
            if natural
            else "gc.collect() before each restore, medians of every restore"
        )
    )
    collector = _Collections()
    wall: dict[int, list[float]] = {n: [] for n in cases}
    collected: dict[int, list[float]] = {n: [] for n in cases}
    full = dict.fromkeys(cases, 0)
    order = list(cases)
    largest = max(order)
    for r in range(rounds):
        for n in order if r % 2 == 0 else order[::-1]:
            path, skeleton = cases[n]
            for _ in range(max(1, min(20, largest // n))):
                if not natural:
                    gc.collect()
                before, passes = collector.seconds, collector.full
                start = time.perf_counter()
                restored = jax.block_until_ready(oeqx.restore(path, skeleton))
                wall[n].append(time.perf_counter() - start)
                collected[n].append(collector.seconds - before)
                full[n] += collector.full - passes
                del restored
    middle = statistics.fmean if natural else statistics.median
    per_leaf = {}
    for n in cases:
        per_leaf[n] = middle(wall[n]) / n * 1e6
        net = middle(w - c for w, c in zip(wall[n], collected[n], strict=True))
        print(
            f"  {n:>7} leaves: {per_leaf[n]:6.1f} us a leaf (best "
            f"{min(wall[n]) / n * 1e6:.1f}); the collector inside "
            f"{middle(collected[n]) / n * 1e6:.1f}; without it "
            f"{net / n * 1e6:.1f}; {len(wall[n])} restores, {full[n]} passes "
            "over the oldest generation inside them"
        )
    first, last = order[0], order[-1]
    ratio = per_leaf[last] / per_leaf[first]
    mark = "PASS" if ratio <= 1.2 else "FAIL"
    print(
        f"  [{mark}] restore us a leaf at {last} / at {first}: {ratio:.2f}x "
        "(target <= 1.2x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", default="1000,10000,100000")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--natural",
        action="store_true",
        help="no gc.collect() between restores; means instead of medians",
    )
    options = parser.parse_args()
    main([int(x) for x in options.leaves.split(",")], options.rounds, options.natural)
