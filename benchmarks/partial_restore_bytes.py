"""Bytes read from disk by a partial restore, against a full restore.

    python benchmarks/partial_restore_bytes.py [--leaves 100] [--kib 4096] [--dir DIR]

Saves a checkpoint of `--leaves` float32 arrays of `--kib` KiB each (random,
so compression cannot shrink them much), as 10 blocks of equal size. Then, each
in a fresh process, restores some of the leaves and prints what the process
read during the restore:

- `rchar` of /proc/self/io: bytes returned by read system calls, from disk or
  page cache: what the restore asked the file system for.
- `read_bytes`: bytes the process made the kernel fetch from the storage
  device. Every file of the checkpoint is first evicted from the page cache
  (`posix_fadvise(DONTNEED)`), so no read is served from memory. It includes
  the kernel's readahead around each read, which depends on where the arrays
  lie in the files, so it varies from run to run.

Both are counted from just before to just after `oeqx.restore`, after a
warm-up restore of another checkpoint has loaded every code path. Each case
runs 3 times; the medians are printed. Linux only; `--dir` must be on a real
disk (tmpfs has no `read_bytes`). A benchmark, not a test: it prints.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
BLOCKS = 10
RUNS = 3

# (label, what the worker restores): a fraction of the leaves through a skeleton
# of some blocks and strict=False, or one block through `prefix=`.
CASES = [
    ("1 leaf, strict=False", {"leaves": 1}),
    ("10% of leaves, strict=False", {"fraction": 0.1}),
    ("one block (10%), prefix=", {"prefix": 3}),
    ("50% of leaves, strict=False", {"fraction": 0.5}),
    ("everything", {"fraction": 1.0}),
]


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def evict(directory: str) -> None:
    """Drops the files of `directory` from the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --------------------------------------------------------------------- worker


def worker(path: str, warmup: str, case: dict, per_block: int, kib: int) -> None:
    import jax
    import numpy as np

    import orbax_eqx as oeqx

    def block(n: int) -> dict:
        leaf = jax.ShapeDtypeStruct((kib * 256,), np.float32)
        return {f"w{j:03d}": leaf for j in range(n)}

    oeqx.restore(warmup, {"w": jax.ShapeDtypeStruct((4,), np.float32)})
    if "prefix" in case:
        skeleton = block(per_block)
        options = {"prefix": f"blocks.{case['prefix']}"}
    elif "leaves" in case:
        skeleton = {"blocks": [block(case["leaves"])]}
        options = {"strict": False}
    else:
        full, rest = divmod(round(case["fraction"] * BLOCKS * per_block), per_block)
        blocks = [block(per_block)] * full + ([block(rest)] if rest else [])
        skeleton = {"blocks": blocks}
        options = {"strict": case["fraction"] == 1.0}
    before = io_counters()
    restored = oeqx.restore(path, skeleton, **options)
    after = io_counters()
    leaves = jax.tree_util.tree_leaves(restored)
    result = {
        "leaves": len(leaves),
        "asked": sum(x.nbytes for x in leaves),
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "rchar": after["rchar"] - before["rchar"],
    }
    print(json.dumps(result))


# --------------------------------------------------------------------- driver


def run(path: str, warmup: str, case: dict, per_block: int, kib: int) -> dict:
    evict(path)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "import partial_restore_bytes as b; "
        "b.worker(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), "
        "int(sys.argv[5]), int(sys.argv[6]))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(HERE), path, warmup]
        + [json.dumps(case), str(per_block), str(kib)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=100, help="a multiple of 10")
    parser.add_argument("--kib", type=int, default=4096, help="KiB per leaf")
    parser.add_argument("--dir", default=None, help="where to save (a real disk)")
    args = parser.parse_args()
    sys.path.insert(0, REPO_ROOT)
    import numpy as np

    import orbax_eqx as oeqx

    per_block = args.leaves // BLOCKS
    work = tempfile.mkdtemp(prefix="partial_restore_", dir=args.dir)
    try:
        rng = np.random.default_rng(0)
        item = {
            "blocks": [
                {
                    f"w{j:03d}": rng.standard_normal(args.kib * 256, np.float32)
                    for j in range(per_block)
                }
                for _ in range(BLOCKS)
            ]
        }
        path, warmup = os.path.join(work, "ckpt"), os.path.join(work, "warmup")
        oeqx.save(path, item)
        oeqx.save(warmup, {"w": np.ones(4, np.float32)})
        on_disk = sum(
            os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(path)
            for f in fs
        )
        total = per_block * BLOCKS * args.kib * 1024
        print(
            f"checkpoint: {per_block * BLOCKS} leaves of {args.kib} KiB, "
            f"{mib(total)} of arrays, {mib(on_disk)} on disk"
        )
        rows = []
        for label, case in CASES:
            runs = [run(path, warmup, case, per_block, args.kib) for _ in range(RUNS)]
            rows.append(
                (label, {k: sorted(r[k] for r in runs)[RUNS // 2] for k in runs[0]})
            )
        full = rows[-1][1]
        print(
            f"{'restored':<30}{'leaves':>7}{'asked':>12}"
            f"{'rchar':>12}{'':>8}{'read_bytes':>12}{'':>8}"
        )
        for label, r in rows:
            print(
                f"{label:<30}{r['leaves']:>7}{mib(r['asked']):>12}"
                f"{mib(r['rchar']):>12}{r['rchar'] / full['rchar']:>8.1%}"
                f"{mib(r['read_bytes']):>12}"
                f"{r['read_bytes'] / full['read_bytes']:>8.1%}"
            )
        print(
            f"Medians of {RUNS} runs, each in a fresh process; % of what the full "
            "restore read.\nread_bytes includes the kernel's readahead."
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
