"""Peak memory of `inspect --stats` and `verify`, against the checkpoint's size.

Saves a checkpoint of `--size` MiB (float32 leaves of `--leaf` MiB each) twice:
with orbax_eqx (packs) and with Orbax's own `StandardCheckpointer` (a plain
Orbax checkpoint, each leaf in chunks of `--chunk` MiB), then measures the peak
resident memory (VmHWM) of, each in a fresh process:

- `inspect` of a tiny checkpoint: the cost of Python, JAX and Orbax alone;
- `inspect --stats` and `verify` of each big checkpoint;
- the obvious alternative for the plain one: restore it whole with Orbax's
  `StandardCheckpointer`, then take numpy's statistics.

    python benchmarks/stats_memory.py --size 1024 --leaf 64

Each child runs the command line through the private `orbax_eqx._cli.main.main`, so
that it can print its own peak memory after the command returns.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import orbax_eqx as oeqx

# The peak resident size of this process alone, in KiB (see export_memory.py).
_PEAK = "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
_CLI = (
    "import sys; from orbax_eqx._cli.main import main; rc = main(sys.argv[1:]); "
    f"{_PEAK}; sys.exit(0 if rc == 0 else rc)"
)
_RESTORE_THEN_STATS = (
    "import sys, numpy as np, orbax.checkpoint as ocp; "
    "tree = ocp.StandardCheckpointer().restore(sys.argv[1]); "
    "[(np.min(x), np.max(x), np.mean(x), np.std(x)) for x in tree.values()]; "
    f"{_PEAK}"
)


def peak_mib(code: str, *args: str) -> tuple[float, float]:
    """Runs `code` in a fresh process; its peak RSS in MiB, and seconds taken."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=True,
    )
    return int(result.stdout.split()[-1]) / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="MiB of arrays")
    parser.add_argument("--leaf", type=int, default=64, help="MiB per leaf")
    parser.add_argument("--chunk", type=int, default=16, help="MiB per Orbax chunk")
    args = parser.parse_args()
    import jax
    import orbax.checkpoint as ocp

    work = tempfile.mkdtemp(prefix="stats_memory_")
    try:
        n = args.size // args.leaf
        side = args.leaf * 2**20 // 4
        rng = np.random.default_rng(0)
        item = {f"w{i}": rng.standard_normal(side, dtype=np.float32) for i in range(n)}
        oeqx.save(os.path.join(work, "eqx"), item, use_compression=False)
        save_args = jax.tree.map(
            lambda _: ocp.SaveArgs(chunk_byte_size=args.chunk << 20), item
        )
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(work, "plain"), item, save_args=save_args)
        del item
        oeqx.save(os.path.join(work, "tiny"), {"w": np.ones(4, np.float32)})
        base, _ = peak_mib(_CLI, "inspect", f"{work}/tiny")
        print(
            f"checkpoint: {args.size} MiB in {n} leaves of {args.leaf} MiB "
            f"(plain Orbax: chunks of {args.chunk} MiB)"
        )
        print(f"{'what':<44}{'peak RSS':>10}{'above base':>12}{'time':>8}")
        print(f"{'inspect of a tiny checkpoint (base)':<44}{base:>7.0f} MiB")
        runs = [
            ("inspect --stats, orbax_eqx", _CLI, "inspect", "--stats", f"{work}/eqx"),
            ("verify, orbax_eqx", _CLI, "verify", f"{work}/eqx"),
            (
                "inspect --stats, plain Orbax",
                _CLI,
                "inspect",
                "--stats",
                f"{work}/plain",
            ),
            ("verify, plain Orbax", _CLI, "verify", f"{work}/plain"),
            (
                "restore whole, then numpy stats (plain)",
                _RESTORE_THEN_STATS,
                f"{work}/plain",
            ),
        ]
        for label, code, *argv in runs:
            peak, seconds = peak_mib(code, *argv)
            print(f"{label:<44}{peak:>7.0f} MiB{peak - base:>8.0f} MiB{seconds:>7.1f}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
