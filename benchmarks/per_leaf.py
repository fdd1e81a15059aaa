"""What each leaf costs: save, restore, memory, sidecar size, metadata, inspect.

    python benchmarks/per_leaf.py [--leaves 1000,10000,50000,100000]
                                  [--repeats 3] [--json FILE]

For each leaf count N, a fresh process builds a model of N small float32
arrays (residual blocks of two `Linear(8, 8)`, a `LayerNorm(8)` and a scalar
gain: 7 arrays and 4 modules per block, ~110 bytes per array on average) on
one CPU device, and measures, medians of `--repeats`:

- `oeqx.save` and `oeqx.restore` (into a `filter_eval_shape`-like skeleton,
  `block_until_ready` included; page cache warm: the cost measured here is
  per leaf, not the disk's), in microseconds per leaf;
- the floor of any restore onto a device: `jax.device_put` of the same N
  host arrays in one call (what orbax_eqx's restore calls for them), with
  the cyclic collector paused as a restore pauses it (`_gc.paused`; with it
  on, the put of 50k leaves took 2x as long, 50 against 21-23 us a leaf);
- inside each restore (ours and eqx's), the time Python's cyclic collector
  ran (`gc.callbacks`), and the restore's growth from the first leaf count
  to the last without it: a restore leaves N new long-lived objects (jax's
  arrays, which the collector tracks, and the modules), and the collector's
  next pass over its oldest generation walks the whole heap;
- baselines: `eqx.tree_serialise_leaves` / `eqx.tree_deserialise_leaves`
  of the same model (one file, no names, no checks);
- the restore's peak resident memory beyond the array bytes, per leaf
  (`VmHWM` after resetting it through `/proc/self/clear_refs`);
- the sidecar's size against the array bytes it describes;
- `oeqx.metadata(path)` and `python -m orbax_eqx inspect PATH` (run in the
  same process, output discarded), in seconds.

The targets: restore and save <= 60 us per leaf, restore
linear from 1k to 100k leaves, restore memory <= 2 KiB per leaf beyond the
data, sidecar no larger than the data, metadata and inspect of 50k leaves
<= 1 s. Everything is printed with its configuration and checked against
the targets, PASS or FAIL; nothing here is a test. It runs `inspect` through the
private `orbax_eqx._cli.main.main`, in this process, to time it without a subprocess.
"""

import argparse
import contextlib
import gc
import io
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from _proc import status as _status

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def _model(n: int):
    """A model of about `n` small arrays, built from numpy (no compilation)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    class Residual(eqx.Module):
        lin1: eqx.nn.Linear
        norm: eqx.nn.LayerNorm
        lin2: eqx.nn.Linear
        gain: jax.Array

    class Stack(eqx.Module):
        blocks: list

    def make(key):
        k1, k2 = jax.random.split(key)
        return Residual(
            eqx.nn.Linear(8, 8, key=k1),
            eqx.nn.LayerNorm(8),
            eqx.nn.Linear(8, 8, key=k2),
            jnp.ones(()),
        )

    one = eqx.filter_eval_shape(make, jax.random.key(0))
    depth = max(1, n // 7)
    abstract = Stack([one] * depth)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    rng = np.random.default_rng(0)
    values = [
        jnp.asarray(rng.standard_normal(x.shape, np.float32))
        if isinstance(x, jax.ShapeDtypeStruct)
        else x
        for x in leaves
    ]
    model = jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, values))
    skeleton = jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
            for x in leaves
        ],
    )
    return model, skeleton


def _saved(n: int, path: str):
    """The model of about `n` arrays saved at `path` by this checkout:
    `(skeleton, number of leaves)`; the model itself is let go."""
    import jax

    import orbax_eqx as oeqx

    model, skeleton = _model(n)
    leaves = len(jax.tree_util.tree_leaves(model))
    oeqx.save(path, model)
    return skeleton, leaves


class _Collections:
    """Time the interpreter's cyclic collector spends inside a measure
    (`gc.callbacks`): a restore leaves N new long-lived objects (jax's
    arrays, which the collector tracks, and the modules), and the first
    collection of the oldest generation after it walks the whole heap."""

    def __init__(self):
        self.seconds = 0.0
        self.full = 0  # passes over the oldest generation (the whole heap)
        self._start = 0.0
        gc.callbacks.append(self._call)

    def _call(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2


_collections = None


def _timed(fn, gc_seconds: list | None = None):
    import jax

    global _collections
    if _collections is None:
        _collections = _Collections()
    before = _collections.seconds
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    took = time.perf_counter() - start
    if gc_seconds is not None:
        gc_seconds.append(_collections.seconds - before)
    return took, out


def probe(n: int, repeats: int, workdir: str) -> dict:
    """Runs in a fresh process: every figure for one leaf count."""
    sys.path.insert(0, str(ROOT))
    import equinox as eqx
    import jax
    import numpy as np

    import orbax_eqx as oeqx
    from orbax_eqx._cli.main import main as cli_main

    model, skeleton = _model(n)
    arrays = [x for x in jax.tree_util.tree_leaves(model) if eqx.is_array(x)]
    data_bytes = sum(x.nbytes for x in arrays)
    hosts = [np.asarray(x).copy() for x in arrays]
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    out: dict = {"leaves": len(arrays), "data_bytes": data_bytes}
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "save",
            "restore",
            "restore_gc",
            "restore_net",
            "device_put",
            "eqx_save",
            "eqx_restore",
            "eqx_restore_gc",
            "metadata",
            "inspect",
        )
    }
    # A first save and restore outside the measure (imports, compilations).
    warm = os.path.join(workdir, "warm")
    oeqx.save(warm, model)
    jax.block_until_ready(oeqx.restore(warm, skeleton))
    for r in range(repeats):
        path = os.path.join(workdir, f"ckpt{r}")
        t, _ = _timed(lambda: oeqx.save(path, model))
        times["save"].append(t)
        t, restored = _timed(lambda: oeqx.restore(path, skeleton), times["restore_gc"])
        times["restore"].append(t)
        times["restore_net"].append(t - times["restore_gc"][-1])
        if r == 0:
            same = all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(
                    jax.tree_util.tree_leaves(restored), arrays, strict=True
                )
            )
            out["verified"] = same
        del restored
        gc.disable()  # as a restore runs it
        try:
            t, put = _timed(lambda: jax.device_put(hosts, sharding))
        finally:
            gc.enable()
        times["device_put"].append(t)
        del put
        eqx_file = os.path.join(workdir, f"eqx{r}.eqx")

        def eqx_save():
            eqx.tree_serialise_leaves(eqx_file, model)
            with open(eqx_file, "rb+") as f:
                os.fsync(f.fileno())

        t, _ = _timed(eqx_save)
        times["eqx_save"].append(t)
        t, _ = _timed(
            lambda: eqx.tree_deserialise_leaves(eqx_file, model),
            times["eqx_restore_gc"],
        )
        times["eqx_restore"].append(t)
        t, _ = _timed(lambda: oeqx.metadata(path))
        times["metadata"].append(t)
        with contextlib.redirect_stdout(io.StringIO()):
            t, code = _timed(lambda: cli_main(["inspect", path]))
        if code != 0:
            raise RuntimeError(f"inspect exited {code}")
        times["inspect"].append(t)
    out["median_s"] = {k: statistics.median(v) for k, v in times.items() if v}
    item = pathlib.Path(path)
    sidecar = item / "orbax_eqx.json"
    out["sidecar_bytes"] = sidecar.stat().st_size
    # Memory: one more restore with the peak reset just before it.
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    restored = jax.block_until_ready(oeqx.restore(path, skeleton))
    out["restore_peak_growth"] = _status("VmHWM") - baseline
    del restored
    return out


def _versions() -> str:
    from importlib.metadata import version

    pkgs = ("jax", "jaxlib", "orbax-checkpoint", "equinox", "numpy")
    return ", ".join(f"{p} {version(p)}" for p in pkgs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", default="1000,10000,50000,100000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.repeats, args.dir)))
        return

    print(
        f"Configuration: backend CPU, 1 device, unsharded, page cache warm; "
        f"medians of {args.repeats}; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}; Python {sys.version.split()[0]}, "
        f"{_versions()}"
    )
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for n in (int(x) for x in args.leaves.split(",")):
        with tempfile.TemporaryDirectory() as workdir:
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--probe",
                    str(n),
                    "--dir",
                    workdir,
                    "--repeats",
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=3600,
            )
        if done.returncode != 0:
            print(done.stdout, done.stderr)
            raise SystemExit(f"the probe for {n} leaves failed")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    us = 1e6
    print(
        f"  {'leaves':>7} {'save us':>8} {'eqx':>6} {'restore us':>10} "
        f"{'gc':>5} {'eqx':>6} {'gc':>5} {'put':>6} {'rest/put':>8} {'mem B/leaf':>10} "
        f"{'sidecar/data':>12} {'metadata s':>10} {'inspect s':>9} verified"
    )
    for row in rows:
        n, m = row["leaves"], row["median_s"]
        extra = (row["restore_peak_growth"] - row["data_bytes"]) / n
        print(
            f"  {n:>7} {m['save'] / n * us:8.1f} {m['eqx_save'] / n * us:6.1f} "
            f"{m['restore'] / n * us:10.1f} {m['restore_gc'] / n * us:5.1f} "
            f"{m['eqx_restore'] / n * us:6.1f} {m['eqx_restore_gc'] / n * us:5.1f} "
            f"{m['device_put'] / n * us:6.1f} {m['restore'] / m['device_put']:8.2f} "
            f"{extra:10.0f} {row['sidecar_bytes'] / row['data_bytes']:12.2f} "
            f"{m['metadata']:10.3f} {m['inspect']:9.3f} {row['verified']}"
        )
    print(
        "  (us: microseconds per leaf; eqx: tree_serialise_leaves + fsync / "
        "tree_deserialise_leaves; put: jax.device_put of the same host arrays "
        "in one call, the floor of a restore onto a device; gc: of the "
        "restore beside it, the time Python's cyclic collector ran inside it "
        "(medians of each); mem: restore's peak RSS growth beyond the array "
        "bytes)"
    )
    first, last = rows[0], rows[-1]
    growth = (last["median_s"]["restore"] / last["leaves"]) / (
        first["median_s"]["restore"] / first["leaves"]
    )
    # Diagnosis, not a target: what the restore's growth is made of. A restore
    # leaves N new long-lived objects (jax's arrays, tracked by the
    # collector, and the modules); Python's next collection of its oldest
    # generation walks the whole heap, eqx's own restore's too.
    for key, what in (("restore_net", "restore"), ("eqx_restore", "eqx restore")):
        net = (last["median_s"][key] / last["leaves"]) / (
            first["median_s"][key] / first["leaves"]
        )
        print(
            f"  {what} us/leaf at {last['leaves']} / at {first['leaves']}"
            f"{' without the collector' if key == 'restore_net' else ''}: "
            f"{net:.2f}"
        )
    checks = []
    for row in rows:
        n, m = row["leaves"], row["median_s"]
        checks.append((f"{n} leaves: save us/leaf", m["save"] / n * us, "<=", 60))
        checks.append((f"{n} leaves: restore us/leaf", m["restore"] / n * us, "<=", 60))
        extra = (row["restore_peak_growth"] - row["data_bytes"]) / n
        checks.append((f"{n} leaves: restore memory B/leaf", extra, "<=", 2048))
        checks.append(
            (
                f"{n} leaves: sidecar / data",
                row["sidecar_bytes"] / row["data_bytes"],
                "<=",
                1.0,
            )
        )
        if 40000 <= n <= 60000:
            checks.append((f"{n} leaves: metadata s", m["metadata"], "<=", 1.0))
            checks.append((f"{n} leaves: inspect s", m["inspect"], "<=", 1.0))
    checks.append(
        (
            f"restore us/leaf at {last['leaves']} / at {first['leaves']} (linear)",
            growth,
            "<=",
            1.2,
        )
    )
    print("Targets:")
    for name, value, op, goal in checks:
        ok = value <= goal
        print(
            f"  [{'PASS' if ok else 'FAIL'}] {name}: {value:.2f} (target {op} {goal})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "versions": _versions()}, f, indent=1)


if __name__ == "__main__":
    main()
