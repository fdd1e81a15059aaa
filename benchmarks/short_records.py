"""Format 6's short records against the same sidecar written whole, A/B.

    python benchmarks/short_records.py [--leaves 50000] [--rounds 7]

On the model of `per_leaf.py` (residual blocks of small arrays), in one
process, the two taking turns (A B, then B A, ...), page cache warm:

- the sidecar's size, short (as a save writes it) and whole (every record
  as format 5 spells it: `compact.expand`, sealed);
- reading it (`sidecar_read.read`), without and with the records of inner
  nodes (a restore into a skeleton reads past them; `metadata` and a
  rebuild read them);
- `oeqx.save` and `oeqx.restore` of the model, with the save writing short
  records or whole ones (the rows it makes as it builds the sidecar, and
  `compact.compact`, both switched off).

Prints medians and bests in microseconds per leaf, with the configuration.
A measurement, never a test.
"""

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from per_leaf import _model  # noqa: E402


def _turns(rounds: int, runs: dict) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for r in range(rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            gc.collect()
            start = time.perf_counter()
            runs[key]()
            times[key].append(time.perf_counter() - start)
    return times


def _line(what: str, times: dict[str, list[float]], n: int) -> None:
    said = ", ".join(
        f"{k} {statistics.median(v) / n * 1e6:.1f} (best {min(v) / n * 1e6:.1f})"
        for k, v in times.items()
    )
    print(f"  {what}: {said} us a leaf")


def main(n: int, rounds: int) -> None:
    import jax
    from etils import epath

    import orbax_eqx as oeqx
    from orbax_eqx._format import compact, sealed, sidecar, sidecar_read, sidecar_write

    model, skeleton = _model(n)
    n = len(jax.tree_util.tree_leaves(model))  # (blocks of 7: about `n`)
    workdir = Path(tempfile.mkdtemp())
    short, whole = workdir / "short", workdir / "whole"
    oeqx.save(short, model)
    shutil.copytree(short, whole)
    content = json.loads((short / sidecar.FILE_NAME).read_text())
    content.pop("checksum")
    (whole / sidecar.FILE_NAME).write_bytes(sealed.dumps(compact.expand(content)))
    data = sum(x.nbytes for x in jax.tree_util.tree_leaves(model))
    sizes = {p.name: os.path.getsize(p / sidecar.FILE_NAME) for p in (short, whole)}
    print(
        f"backend CPU, 1 device, unsharded, page cache warm; {n} leaves, "
        f"{data} bytes of data; {os.cpu_count()} CPUs; Python "
        f"{platform.python_version()}, jax {jax.__version__}; medians of "
        f"{rounds} turns"
    )
    print(
        f"  sidecar: short {sizes['short']} bytes ({sizes['short'] / data:.2f}x "
        f"the data), whole {sizes['whole']} ({sizes['whole'] / data:.2f}x)"
    )
    for nodes in (False, True):
        runs = {
            name: (lambda p=p: sidecar_read.read(epath.Path(p), nodes=nodes))
            for name, p in (("short", short), ("whole", whole))
        }
        _line(f"read, nodes={nodes}", _turns(rounds, runs), n)

    to_bytes, row = sidecar_write.to_bytes, sidecar._row

    def switched(on: bool) -> None:
        sidecar_write.to_bytes = to_bytes if on else sealed.dumps
        sidecar._row = row if on else (lambda *args: None)

    def save(on: bool) -> None:
        switched(on)
        path = workdir / ("save-short" if on else "save-whole")
        shutil.rmtree(path, ignore_errors=True)
        oeqx.save(path, model)

    def restore(on: bool) -> None:
        path = workdir / ("save-short" if on else "save-whole")
        jax.block_until_ready(oeqx.restore(path, skeleton))

    save(True), save(False)  # (warm)
    _line(
        "save",
        _turns(rounds, {"short": lambda: save(True), "whole": lambda: save(False)}),
        n,
    )
    _line(
        "restore",
        _turns(
            rounds, {"short": lambda: restore(True), "whole": lambda: restore(False)}
        ),
        n,
    )
    switched(True)
    shutil.rmtree(workdir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    main(args.leaves, args.rounds)
