"""What the largest sidecar costs to read: a flat tree of N tiny leaves.

    python benchmarks/max_sidecar.py [--leaves 1000000] [--dir DIR]

The sidecar is bounded (256 MiB and 2**21 records: leaves, modules and
nodes; `_format/sealed.py: MAX_BYTES, MAX_RECORDS`), so the longest a
restore can be made to work on one is bounded by how fast the largest
sidecar reads. A flat dict of N float32 arrays of 2 elements has no modules
and one node, so nearly all of its sidecar is leaf records: whole (format
5's spelling) about 225 bytes each, so that a million of them came close to
256 MiB; as format 6's rows about 55 bytes, so that the record count binds
first (2**21, about twice a million). One process
(CPU, 1 device, page cache warm) saves it once, then times, each in a fresh
process so that peak memory is its own:

- `oeqx.restore` into the same tree (a skeleton);
- `oeqx.metadata`;
- `oeqx.restore` into a skeleton of one leaf (the error listing every
  difference: a mismatched or hostile checkpoint);

with the peak resident memory of each (`VmHWM`, beyond the process's before
the call). A benchmark, not a test: it prints. Linux only.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)
from _proc import status as _status  # noqa: E402


def _tree(n: int):
    import numpy as np

    return {f"p{i:07d}": np.full((2,), i, np.float32) for i in range(n)}


def probe(what: str, path: str, n: int) -> None:
    import numpy as np

    import orbax_eqx as oeqx

    if what == "mismatch":
        skeleton = {"other": np.zeros((2,), np.float32)}
    else:
        skeleton = _tree(n)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    t = time.perf_counter()
    outcome = "ok"
    if what == "metadata":
        oeqx.metadata(path)
    else:
        try:
            oeqx.restore(path, skeleton)
        except oeqx.CheckpointMismatchError as e:
            outcome = f"CheckpointMismatchError, {len(str(e))} characters"
    seconds = time.perf_counter() - t
    print(
        "RESULT "
        + json.dumps(
            {"s": seconds, "peak": _status("VmHWM") - base, "outcome": outcome}
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--probe", default=None)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe, args.dir, args.leaves)
        return
    import jax

    import orbax_eqx as oeqx

    work = args.dir or tempfile.mkdtemp(prefix="max-sidecar-")
    path = os.path.join(work, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    print(
        f"{args.leaves} leaves of float32 (2,), flat dict; python "
        f"{sys.version.split()[0]}, jax {jax.__version__}, CPU, 1 device, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    tree = _tree(args.leaves)
    t = time.perf_counter()
    oeqx.save(path, tree)
    saved = time.perf_counter() - t
    del tree
    sidecar = os.path.getsize(os.path.join(path, "orbax_eqx.json"))
    data = args.leaves * 8
    print(
        f"save {saved:.1f} s ({saved / args.leaves * 1e6:.0f} us a leaf); sidecar "
        f"{sidecar / 2**20:.1f} MiB ({sidecar / args.leaves:.0f} bytes a leaf, "
        f"{sidecar / 2**28:.2f} of the 256 MiB limit; data {data / 2**20:.1f} MiB)",
        flush=True,
    )
    for what in ("restore", "metadata", "mismatch"):
        argv = [sys.executable, HERE, "--probe", what, "--dir", path]
        argv += ["--leaves", str(args.leaves)]
        done = subprocess.run(argv, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{what} failed:\n{done.stderr[-3000:]}")
        r = json.loads(lines[-1][7:])
        print(
            f"{what:<9} {r['s']:7.1f} s  {r['s'] / args.leaves * 1e6:5.0f} us a leaf  "
            f"peak {r['peak'] / 2**20:7.0f} MiB ({r['peak'] / sidecar:.1f}x the "
            f"sidecar)  {r['outcome']}",
            flush=True,
        )
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
