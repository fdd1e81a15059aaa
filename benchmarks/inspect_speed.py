"""`python -m orbax_eqx inspect` of a many-leaf checkpoint, A/B against a git
revision, in one process.

    python benchmarks/inspect_speed.py [--leaves 50000] [--rounds 7]
                                       [--base main]

Saves the model of `per_leaf.py` (residual blocks of small arrays) with this
checkout, then times `inspect PATH` through each version's `cli_main` (output
discarded), taking turns (A B, then B A, ...), `gc.collect()` before each,
page cache warm. The base is the package as committed at `--base`, extracted
with `git archive` and imported under another name. Then, for this checkout
only, where the time goes: reading the sidecar (`gather`), the tree view, the
rebuild plan's dry run, and the collection that follows.

Prints medians and bests in seconds, with the configuration. Issue 30's
target: inspect of 50,000 leaves <= 1 s. A measurement, never a test.
"""

import argparse
import contextlib
import gc
import io
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


def _base_cli(rev: str, into: Path):
    """`cli.main` of the package as committed at `rev` (see `_base.py`)."""
    return import_base(rev, into, "_tools.cli").main


def _output(main, argv: list[str]) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(["inspect", *argv])
    return f"{code}\n{out.getvalue()}"


def _quiet(main, path: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["inspect", path])
    if code != 0:
        raise RuntimeError(f"inspect exited {code}")


def _stages(path: str, rounds: int) -> dict[str, list[float]]:
    """This checkout's inspect, stage by stage, as the command line runs it."""
    from orbax_eqx._gc import paused
    from orbax_eqx._tools import tree_view
    from orbax_eqx._tools.inspect import gather, rebuild_plan
    from orbax_eqx._tools.text import table

    times: dict[str, list[float]] = {}

    def note(what: str, since: float) -> float:
        now = time.perf_counter()
        times.setdefault(what, []).append(now - since)
        return now

    for _ in range(rounds):
        gc.collect()
        t = time.perf_counter()
        with paused():
            report = gather(path)
            t = note("read the sidecar (gather)", t)
            saved, shardings = report.items[0], report.shardings[0]
            rows = tree_view.rows(saved, shardings)
            t = note("tree view rows", t)
            text = table(["name"] * 7, rows, right=(3,))
            t = note("table", t)
            rebuild_plan(saved)
            t = note("rebuild plan (dry run)", t)
            del report, saved, shardings, rows, text
            t = note("freeing", t)
        gc.collect(0)  # what the first collection after the command walks
        note("first collection after", t)
    return times


def main(n: int, rounds: int, base: str) -> None:
    import jax

    from orbax_eqx._tools.cli import main as ours

    workdir = Path(tempfile.mkdtemp())
    theirs = _base_cli(base, workdir / "base")
    path = str(workdir / "ckpt")
    _, n = _saved(n, path)
    head = checkout_head()
    print(
        f"inspect of {n} leaves ({os.path.getsize(Path(path) / 'orbax_eqx.json')} "
        f"bytes of sidecar); {os.cpu_count()} CPUs; Python "
        f"{platform.python_version()}, jax {jax.__version__}; page cache warm; "
        f"medians of {rounds}, taking turns, one process"
    )
    runs = {
        f"base ({base})": lambda: _quiet(theirs, path),
        f"this checkout ({head}+)": lambda: _quiet(ours, path),
    }
    for run in runs.values():  # warm: imports, first reads
        run()
    for extra in ([], ["--all"], ["--flat"], ["--json"]):
        said = [_output(main, [*extra, path]) for main in (theirs, ours)]
        print(f"  output of inspect {' '.join(extra)}: ", end="")
        print("the same" if said[0] == said[1] else "DIFFERENT")
    times = _turns(rounds, runs)
    for what, t in times.items():
        print(f"  {what:>28}: {statistics.median(t):.3f} s (best {min(t):.3f})")
    a, b = (statistics.median(t) for t in times.values())
    print(f"  this checkout / base: {b / a:.2f}x")
    print("Where this checkout's time goes (medians):")
    for what, t in _stages(path, rounds).items():
        print(f"  {what:>28}: {statistics.median(t):.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--base", default="main", help="git revision (default main)")
    options = parser.parse_args()
    main(options.leaves, options.rounds, options.base)
