"""A waited save, this checkout against a base revision, in turns in one process.

    python benchmarks/save_ab.py [--leaves 1000,50000] [--rounds 9]
                                 [--base main]

For each leaf count, the model of `per_leaf.py` (residual blocks of small
float32 arrays, one CPU device) is saved with `oeqx.save` by this checkout
and by the package as committed at `--base` (see `_base.py`), alternating which
goes first, with `os.sync()` before every save so that neither pays for the
other's writes. Both are warmed first (the first save of a tree structure
walks it before returning). Prints microseconds a leaf (median and best) and
the ratio of medians, and checks that both wrote the same bytes (every file, saved
with one token). The VM is shared and noisy: only the ratio from
one run means much. Nothing here is a test.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from _base import import_base  # noqa: E402
from per_leaf import _model  # noqa: E402

_ORBAX_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")


def _same_files(saves: list, model, workdir: pathlib.Path) -> bool:
    """Whether each of `saves` writes the same files of the same bytes for
    `model`, saved with one token (a save's token names its files and is
    bound into its checksums), Orbax's own files (a time, a path) aside."""
    from orbax_eqx._format.sidecar import FILE_NAME

    found = []
    for i, save in enumerate(saves):
        claim = sys.modules[save.__module__.rsplit(".", 2)[0] + "._save.claim"]
        new_token = claim.new_token
        claim.new_token = lambda: "0123456789abcdef"
        try:
            path = workdir / f"same-{i}"
            save(path, model)
        finally:
            claim.new_token = new_token
        found.append(
            {
                p.name: p.read_bytes()
                for p in sorted(path.iterdir())
                if p.name not in _ORBAX_FILES
            }
        )
        shutil.rmtree(path)
    return FILE_NAME in found[0] and all(f == found[0] for f in found)


def main(counts: list[int], rounds: int, base: str) -> None:
    import jax

    import orbax_eqx as oeqx

    workdir = pathlib.Path(tempfile.mkdtemp())
    theirs = import_base(base, workdir / "base", "_orbax.api").save
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(
        f"backend {jax.default_backend()}, 1 device, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}, jax {jax.__version__}; waited "
        f"`oeqx.save`, page cache warm, os.sync() before each; {rounds} rounds "
        "in turns"
    )
    for n in counts:
        model, _ = _model(n)
        leaves = len(jax.tree_util.tree_leaves(model))
        runs = {f"base ({base})": theirs, f"this checkout ({head}+)": oeqx.save}
        made: dict[str, list[pathlib.Path]] = {k: [] for k in runs}
        for key, save in runs.items():  # warm: imports, the first walk
            path = workdir / f"warm-{len(made[key])}-{hash(key)}"
            save(path, model)
            made[key].append(path)
        times: dict[str, list[float]] = {k: [] for k in runs}
        keys = list(runs)
        for r in range(rounds):
            for key in keys if r % 2 == 0 else keys[::-1]:
                path = workdir / f"{n}-{r}-{keys.index(key)}"
                os.sync()
                start = time.perf_counter()
                runs[key](path, model)
                times[key].append(time.perf_counter() - start)
                made[key].append(path)
        said = ", ".join(
            f"{k} {statistics.median(v) / leaves * 1e6:.1f} "
            f"(best {min(v) / leaves * 1e6:.1f})"
            for k, v in times.items()
        )
        a, b = (statistics.median(times[k]) for k in keys)
        same = _same_files(list(runs.values()), model, workdir)
        print(f"  {leaves} leaves: {said} us a leaf; this / base {b / a:.2f}x")
        print(f"    same bytes written (one token): {same}")
        for paths in made.values():
            for p in paths:
                shutil.rmtree(p)
    shutil.rmtree(workdir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="1000,50000")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--base", default="main", help="git revision (default main)")
    options = parser.parse_args()
    main([int(x) for x in options.leaves.split(",")], options.rounds, options.base)
