"""Save and restore time and peak memory of sharded arrays, against plain Orbax.

    python benchmarks/sharded.py [--repeats N] [--only s400,b,a] [--devices 8]
                                 [--json FILE]

Every array of a model whose leading dimension divides by the device count is
sharded `P("fsdp")` over all devices of one process (fake CPU devices unless
the backend has real ones); the others are replicated. Measured in one run,
contenders taking turns (A B C, then B C A, ...), medians of the rounds:

- save time, and restore time from a cold page cache onto the saving mesh;
- restore time onto another mesh: ("x", "y") of shape (n/2, 2), the same
  arrays sharded `P("x")`, so every restored shard is two saved chunks;
- for the largest model, the raw disk: the same bytes written with
  `pwritev` + fsync from host memory (the bandwidth a save can reach);
- peak host RSS of a restore in a fresh process, over the bytes restored,
  and the same for the arrays alone, made from filled host buffers with
  nothing read (`_contenders.ArraysAlone`): the least any restore holds.

Models: `s400` is 100 blocks of `Linear(64, 64)` + `LayerNorm(64)` (400
arrays), `b` the 6,313-leaf deep model + Adam state of `run.py`, `a` its
~0.5 GiB transformer. Plain Orbax is `StandardCheckpointer` on
`eqx.filter(item, eqx.is_array)`, restored into abstract arrays with the
target shardings (as its docs suggest for Equinox).
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]


def _flags(devices: int) -> None:
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={devices}"]
    )


_parser = argparse.ArgumentParser()
_parser.add_argument("--repeats", type=int, default=3)
_parser.add_argument("--only", default="s400,b,a")
_parser.add_argument("--devices", type=int, default=8)
_parser.add_argument("--json")
_parser.add_argument("--probe", nargs=4, metavar=("CONTENDER", "MODEL", "MESH", "PATH"))
ARGS = _parser.parse_args()
_flags(ARGS.devices)

import _contenders  # noqa: E402
import _models  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from _proc import status as _status  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

GiB = 2**30


def _stack(key):
    keys = jax.random.split(key, 100)
    return [(eqx.nn.Linear(64, 64, key=k), eqx.nn.LayerNorm(64)) for k in keys]


_models.MODELS["s400"] = _models.Spec("100 x (Linear(64, 64) + LayerNorm(64))", _stack)


def mesh_of(kind: str):
    n = jax.device_count()
    if kind == "save":
        return jax.make_mesh((n,), ("fsdp",)), P("fsdp")
    return jax.make_mesh((max(n // 2, 1), min(n, 2)), ("x", "y")), P("x")


def placement(tree, kind: str):
    """A sharding per array leaf: leading dimension over the mesh, else replicated."""
    mesh, spec = mesh_of(kind)
    n = mesh.shape[spec[0]]

    def one(x):
        if not (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
            return None
        sharded = x.ndim >= 1 and x.shape[0] % n == 0
        return NamedSharding(mesh, spec if sharded else P())

    return jax.tree_util.tree_map(one, tree)


def sharded_item(name: str):
    item = _models.build(name)
    shardings = placement(item, "save")
    return jax.tree_util.tree_map(
        lambda x, s: jax.device_put(x, s) if s is not None else x, item, shardings
    )


def skeleton(name: str, kind: str):
    sk = _models.skeleton(name)
    shardings = placement(sk, kind)
    return jax.tree_util.tree_map(
        lambda x, s: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if s is not None else x
        ),
        sk,
        shardings,
    )


class OrbaxEqx:
    name = "orbax_eqx"

    def save(self, path, item):
        oeqx.save(path, item)

    def restore(self, path, sk):
        return oeqx.restore(path, sk)


class Orbax:
    name = "orbax"

    def __init__(self):
        self._ckptr = ocp.StandardCheckpointer()

    def save(self, path, item):
        self._ckptr.save(path, eqx.filter(item, eqx.is_array))
        self._ckptr.wait_until_finished()

    def restore(self, path, sk):
        abstract, static = eqx.partition(
            sk, lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )
        return eqx.combine(self._ckptr.restore(path, abstract), static)


CONTENDERS = {c.name: c for c in (OrbaxEqx, Orbax)}


def probe(contender: str, model: str, kind: str, path: str) -> None:
    """Peak RSS of one restore, in this fresh process: one JSON line."""
    sk = skeleton(model, kind)
    runner = {**CONTENDERS, "arrays": _contenders.ArraysAlone}[contender]()
    jax.block_until_ready(jax.device_put(np.zeros(4)))
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    restored = jax.block_until_ready(runner.restore(path, sk))
    seconds = time.perf_counter() - start
    print(json.dumps({"baseline": baseline, "peak": _status("VmHWM"), "s": seconds}))
    del restored


def _probe(contender, model, kind, path):
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--devices",
            str(ARGS.devices),
            "--probe",
            contender,
            model,
            kind,
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def _same(a, b) -> bool:
    xs = [x for x in jax.tree_util.tree_leaves(a) if eqx.is_array(x)]
    ys = [y for y in jax.tree_util.tree_leaves(b) if eqx.is_array(y)]
    return len(xs) == len(ys) and all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(xs, ys, strict=True)
    )


def _raw_write(path, hosts) -> float:
    """Seconds to write `hosts` end to end with pwritev and fsync."""
    os.makedirs(path)
    views = [memoryview(h.reshape(-1).view(np.uint8)) for h in hosts]
    fd = os.open(os.path.join(path, "raw"), os.O_WRONLY | os.O_CREAT, 0o644)
    start = time.perf_counter()
    try:
        offset = 0
        for i in range(0, len(views), 512):
            offset += _contenders._pwritev_all(fd, views[i : i + 512], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def bench(name, workdir, repeats):
    item = sharded_item(name)
    arrays = [x for x in jax.tree_util.tree_leaves(item) if eqx.is_array(x)]
    nbytes = sum(x.nbytes for x in arrays)
    sharded = sum(not x.is_fully_replicated for x in arrays)
    label = _models.MODELS[name].label
    print(
        f"== {label}: {len(arrays)} arrays ({sharded} sharded), "
        f"{nbytes / 2**20:.1f} MiB",
        flush=True,
    )
    runners = [c() for c in CONTENDERS.values()]
    sk = {kind: skeleton(name, kind) for kind in ("save", "other")}
    times = {c.name: {"save": [], "restore": [], "other": []} for c in runners}
    raw = []
    hosts = [np.asarray(x) for x in arrays] if name == "a" else None
    for c in runners:  # warm up: imports, thread pools, compiled transfers
        path = workdir / f"warm-{c.name}"
        c.save(path, item)
        for kind in ("save", "other"):  # both meshes: neither pays first
            jax.block_until_ready(c.restore(path, sk[kind]))
        shutil.rmtree(path)
    kept = {}
    for rep in range(repeats):
        order = runners[rep % len(runners) :] + runners[: rep % len(runners)]
        for c in order:
            path = workdir / f"{name}-{c.name}-{rep}"
            t_save, _ = _timed(c.save, path, item)
            _contenders.evict(path)
            t_restore, restored = _timed(c.restore, path, sk["save"])
            if rep == 0:
                assert _same(restored, item), f"{c.name} restored other values"
            del restored
            _contenders.evict(path)
            t_other, restored = _timed(c.restore, path, sk["other"])
            if rep == 0:
                assert _same(restored, item), f"{c.name} resharded other values"
            del restored
            for k, v in (("save", t_save), ("restore", t_restore), ("other", t_other)):
                times[c.name][k].append(v)
            print(
                f"   rep {rep} {c.name:9s} save {t_save:7.3f} s  restore "
                f"{t_restore:7.3f} s  onto another mesh {t_other:7.3f} s",
                flush=True,
            )
            if rep == repeats - 1:
                kept[c.name] = path
            else:
                shutil.rmtree(path)
        if hosts is not None:
            path = workdir / f"raw-{rep}"
            raw.append(_raw_write(path, hosts))
            shutil.rmtree(path)
    count = len(arrays)
    del item, arrays, hosts
    rss = {}
    for c in runners:
        _contenders.evict(kept[c.name])
        r = _probe(c.name, name, "save", kept[c.name])
        rss[c.name] = (r["peak"] - r["baseline"]) / nbytes
        shutil.rmtree(kept[c.name])
    r = _probe("arrays", name, "save", workdir)  # the floor: nothing read
    rss["arrays"] = (r["peak"] - r["baseline"]) / nbytes
    med = {c: {k: statistics.median(v) for k, v in t.items()} for c, t in times.items()}
    return {
        "label": label,
        "arrays": count,
        "sharded": sharded,
        "nbytes": nbytes,
        "times": times,
        "median": med,
        "raw_write": statistics.median(raw) if raw else None,
        "rss": rss,
    }


def report(results) -> str:
    lines = []
    for name, r in results.items():
        m, rss = r["median"], r["rss"]
        lines.append(
            f"{r['label']}: {r['arrays']} arrays ({r['sharded']} sharded), "
            f"{r['nbytes'] / 2**20:.1f} MiB"
        )
        lines.append(
            f"  {'contender':10s} {'save s':>8s} {'restore s':>10s} "
            f"{'other mesh s':>13s} {'peak RSS':>9s}"
        )
        for c, t in m.items():
            lines.append(
                f"  {c:10s} {t['save']:8.3f} {t['restore']:10.3f} "
                f"{t['other']:13.3f} {rss[c]:8.2f}x"
            )
        if "arrays" in rss:
            lines.append(
                f"  peak RSS of the arrays alone (made from filled host buffers, "
                f"nothing read): {rss['arrays']:.2f}x; orbax_eqx / that: "
                f"{rss['orbax_eqx'] / rss['arrays']:.2f}x"
            )
        me, them = m["orbax_eqx"], m["orbax"]
        lines.append(
            f"  orbax_eqx vs plain Orbax: save {them['save'] / me['save']:.1f}x "
            f"faster, restore {them['restore'] / me['restore']:.1f}x faster, onto "
            f"another mesh {them['other'] / me['other']:.1f}x faster"
        )
        lines.append(
            f"  orbax_eqx restore onto another mesh / onto the saving "
            f"mesh: {me['other'] / me['restore']:.2f}x"
        )
        if r["raw_write"]:
            lines.append(
                f"  save throughput / fsync'd raw write of the same bytes: "
                f"{r['raw_write'] / me['save']:.2f}x "
                f"(raw {r['nbytes'] / GiB / r['raw_write']:.2f} GiB/s)"
            )
    return "\n".join(lines)


def config() -> str:
    import importlib.metadata as md

    devices = jax.devices()
    return (
        f"backend {jax.default_backend()} ({devices[0].device_kind}), "
        f"{len(devices)} devices in 1 process, arrays sharded P('fsdp') over all; "
        f"python {platform.python_version()}, jax {jax.__version__}, "
        f"orbax-checkpoint {md.version('orbax-checkpoint')}, "
        f"tensorstore {md.version('tensorstore')}, {os.cpu_count()} CPUs"
    )


def main():
    if ARGS.probe:
        probe(*ARGS.probe)
        return
    print(config(), flush=True)
    results = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for name in ARGS.only.split(","):
            results[name] = bench(name, pathlib.Path(tmp), ARGS.repeats)
    print()
    print(config())
    print(f"medians of {ARGS.repeats} alternating rounds")
    print(report(results))
    if ARGS.json:
        pathlib.Path(ARGS.json).write_text(
            json.dumps({"config": config(), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
