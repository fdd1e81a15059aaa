"""Peak memory of `export --to safetensors`, against the checkpoint's size.

Saves a checkpoint of `--size` MiB (float32 leaves of `--leaf` MiB each), then
measures the peak resident memory (VmHWM) of, each in a fresh process:

- `export` of a tiny checkpoint: the cost of Python, JAX and Orbax alone;
- `export` of the big checkpoint with `--buffer` of each size asked;
- the obvious alternative: `orbax_eqx.restore` everything, then
  `safetensors.numpy.save_file`.

    python benchmarks/export_memory.py --size 1024 --buffers 64 256

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

# The peak resident size of this process alone, in KiB. Not ru_maxrss: Linux
# carries that over from the parent through fork and exec.
_PEAK = "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
_EXPORT = (
    "import sys; from orbax_eqx._cli.main import main; rc = main(sys.argv[1:]); "
    f"{_PEAK}; sys.exit(rc)"
)
_RESTORE_THEN_SAVE = (
    "import sys, numpy as np, orbax_eqx as oeqx; "
    "from safetensors.numpy import save_file; flat = oeqx.restore(sys.argv[1]); "
    f"save_file({{k: np.asarray(v) for k, v in flat.items()}}, sys.argv[2]); {_PEAK}"
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
    parser.add_argument("--leaf", type=int, default=16, help="MiB per leaf")
    parser.add_argument("--buffers", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="export_memory_")
    try:
        n = args.size // args.leaf
        side = args.leaf * 2**20 // 4
        item = {f"layers.{i}.weight": np.full(side, i, np.float32) for i in range(n)}
        oeqx.save(os.path.join(work, "big"), item, use_compression=False)
        del item
        oeqx.save(os.path.join(work, "tiny"), {"w": np.ones(4, np.float32)})
        base, _ = peak_mib(
            _EXPORT, "export", f"{work}/tiny", "--to", "safetensors", f"{work}/t"
        )
        print(f"checkpoint: {args.size} MiB in {n} leaves of {args.leaf} MiB")
        print(f"{'what':<44}{'peak RSS':>10}{'above base':>12}{'time':>8}")
        print(
            f"{'export of a tiny checkpoint (base)':<44}{base:>7.0f} MiB{'':>12}{'':>8}"
        )
        for buffer in args.buffers:
            out = f"{work}/out{buffer}"
            peak, seconds = peak_mib(
                _EXPORT,
                "export",
                f"{work}/big",
                "--to",
                "safetensors",
                out,
                "--buffer",
                f"{buffer}MiB",
                "--max-shard-size",
                "5GB",
            )
            print(
                f"{f'export --buffer {buffer}MiB':<44}{peak:>7.0f} MiB"
                f"{peak - base:>8.0f} MiB{seconds:>7.1f}s"
            )
            shutil.rmtree(out)
        peak, seconds = peak_mib(
            _RESTORE_THEN_SAVE, f"{work}/big", f"{work}/naive.safetensors"
        )
        print(
            f"{'restore everything, then save_file':<44}{peak:>7.0f} MiB"
            f"{peak - base:>8.0f} MiB{seconds:>7.1f}s"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
