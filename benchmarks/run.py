"""Save and restore time, peak memory and async block: against Orbax, eqx, the disk.

    python benchmarks/run.py [--big] [--repeats N] [--only a,b] [--json FILE]
                             [--staging auto|copy]

Measures, in one run and on the same arrays: save time, restore time (into a
`filter_eval_shape` skeleton, from a cold page cache), the time
`CheckpointManager.save` blocks its caller with async checkpointing on against
the time to copy the arrays to host memory (`np.array` and `jax.device_get`),
the peak host memory of a restore, each in a fresh process (and, as a floor,
that of making the same arrays from filled host buffers, nothing read), and the devices'
peak memory during saves and restores (`device.memory_stats()`, where the
backend has it: not on CPU). Contenders take turns (A B C D, then B C D A,
...) and every figure is a median, because the machine is shared and noisy
and only same-run ratios are stable. Prints the issue's targets with
PASS/FAIL. See `_contenders.py` for exactly what each contender runs.

`--staging copy` sets `BENCHMARK_STAGING=copy` for the run and its probes:
orbax_eqx's restores then pass the default window as `max_staged_bytes`, so
CPU devices copy host buffers through it as an accelerator does (see
`orbax_eqx/_storage/transfer/staging.py`); saves on CPU take views either way.

It imports `orbax_eqx._storage.transfer.to_host.host_copies` (private) to time the
save's host copies alone, which no public call isolates.
"""

import argparse
import gc
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
# The checkout's package, not whatever is installed.
sys.path[:0] = [str(ROOT), str(HERE)]

import _contenders  # noqa: E402
import _models  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import orbax_eqx  # noqa: E402
from orbax_eqx._storage.transfer.to_host import host_copies  # noqa: E402

GiB = 2**30
ASYNC = ("orbax_eqx", "orbax")
_TINY = None  # a small item for warming up


_STARTED = time.perf_counter()


def _log(text):
    print(f"[{time.perf_counter() - _STARTED:5.0f} s] {text}", flush=True)


def _timed(fn, *args):
    gc.collect()
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def _rotated(items, shift):
    shift %= len(items)
    return items[shift:] + items[:shift]


def _same(restored, item) -> bool:
    a = _contenders.host_views(restored)
    b = _contenders.host_views(item)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def _tiny():
    return {"w": jnp.ones((4, 4)), "lin": eqx.nn.Linear(2, 2, key=jax.random.key(0))}


def _warm_up(contenders, workdir):
    """One tiny save and restore each: imports, compiles, thread pools."""
    global _TINY
    _TINY = item = _tiny()
    skeleton = eqx.filter_eval_shape(lambda: item)
    for c in contenders:
        path = workdir / f"warm-{c.name}"
        c.save(path, item)
        jax.block_until_ready(c.restore(path, skeleton))
        shutil.rmtree(path)


def bench_model(name, contenders, args, workdir):
    spec = _models.MODELS[name]
    began = time.perf_counter()
    _log(f"== {spec.label}: building ...")
    item = _models.build(name)
    skeleton = _models.skeleton(name)
    arrays = _models.array_leaves(item)
    nbytes = sum(x.nbytes for x in _contenders.host_views(item))
    _log(f"   {len(arrays)} arrays, {nbytes / GiB:.3f} GiB")
    out = {
        "label": spec.label,
        "arrays": len(arrays),
        "nbytes": nbytes,
        "save": {c.name: [] for c in contenders},
        "restore": {c.name: [] for c in contenders},
        "disk": {},
        "verified": {},
    }
    kept = {}
    for rep in range(args.repeats):
        for c in _rotated(contenders, rep):
            path = workdir / name / f"{c.name}-{rep}"
            fresh = _fresh(item)  # uncached on device, as after a training step
            t_save, _ = _timed(c.save, path, fresh)
            del fresh
            out["disk"][c.name] = _contenders.disk_bytes(path)
            if not args.warm:
                _contenders.evict(path)
            t_restore, restored = _timed(c.restore, path, skeleton)
            if rep == 0 and c.name != "raw":
                out["verified"][c.name] = _same(restored, item)
            del restored
            out["save"][c.name].append(t_save)
            out["restore"][c.name].append(t_restore)
            _log(
                f"   rep {rep} {c.name:10s} save {t_save:7.3f} s  "
                f"restore {t_restore:7.3f} s"
            )
            if rep == args.repeats - 1:
                kept[c.name] = path
            else:
                shutil.rmtree(path)
    out["async"] = _bench_async(name, item, contenders, args, workdir)
    del item, arrays
    gc.collect()
    out["rss"] = {}
    for c in contenders:
        _contenders.evict(kept[c.name])
        out["rss"][c.name] = _probe(c.name, name, kept[c.name])
        peak = out["rss"][c.name]
        _log(
            f"   restore peak RSS {c.name:10s} "
            f"{(peak['peak'] - peak['baseline']) / nbytes:5.2f}x model bytes"
        )
        shutil.rmtree(kept[c.name])
    # The floor: the arrays alone, from filled host buffers, nothing read.
    out["rss_floor"] = _probe("arrays", name, workdir)
    floor = out["rss_floor"]["peak"] - out["rss_floor"]["baseline"]
    _log(f"   peak RSS of the arrays alone {floor / nbytes:5.2f}x model bytes")
    out["seconds"] = time.perf_counter() - began
    _log(f"   ({out['seconds']:.0f} s for this model)")
    return out


def _copy_to_host(arrays):
    return [np.array(x, copy=True) for x in arrays]


def _device_get(arrays):
    return jax.device_get(arrays)


def _host_copies(arrays):
    # What orbax_eqx's save takes before it returns, and nothing else: the
    # part of its blocked time that device-to-host copies cost.
    return host_copies(arrays)


def device_memory():
    """`(bytes in use, peak bytes in use)` over local devices, or None where
    the backend keeps no such figures (CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if not all(stats) or not all("peak_bytes_in_use" in s for s in stats):
        return None
    return (
        sum(s["bytes_in_use"] for s in stats),
        sum(s["peak_bytes_in_use"] for s in stats),
    )


def _fresh(item):
    """`item` with every jax array copied on its device. A jax array keeps the
    host copy that its first transfer made (`np.asarray`, `jax.device_get`),
    and later transfers return it: on an accelerator every lane after the
    first would time a cached copy. (On CPU the host copy is a view.)"""
    fresh = jax.tree_util.tree_map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, item
    )
    return jax.block_until_ready(fresh)


def _bench_async(name, item, contenders, args, workdir):
    """`CheckpointManager.save` with async on: how long it blocks the caller."""
    managers = {}
    for c in contenders:
        if c.name in ASYNC:
            root = workdir / name / f"manager-{c.name}"
            mngr, make_args = c.manager(root)
            mngr.save(0, args=make_args(_TINY))  # warm: creates the root
            mngr.wait_until_finished()
            managers[c.name] = (mngr, make_args, root)
    baselines = {
        "copy": _copy_to_host,
        "device_get": _device_get,
        "host_copies": _host_copies,
    }
    result = {**{n: [] for n in baselines}, **{n: [] for n in managers}}
    totals = {n: [] for n in managers}
    device_peak = {n: None for n in managers}  # bytes above what was in use
    lanes = [*baselines, *managers]
    for rep in range(args.repeats):
        for lane in _rotated(lanes, rep):
            fresh = _fresh(item)
            if lane in baselines:
                t, held = _timed(baselines[lane], _models.array_leaves(fresh))
                del held, fresh
                result[lane].append(t)
                continue
            mngr, make_args, _ = managers[lane]
            gc.collect()
            before = device_memory()
            start = time.perf_counter()
            mngr.save(rep + 1, args=make_args(fresh))
            blocked = time.perf_counter() - start
            mngr.wait_until_finished()
            totals[lane].append(time.perf_counter() - start)
            result[lane].append(blocked)
            after = device_memory()
            if before is not None and after[1] > before[1]:
                # The peak rose during this save: its own peak is known.
                extra = after[1] - before[0]
                device_peak[lane] = max(device_peak[lane] or 0, extra)
        _log(
            f"   rep {rep} async block: "
            + "  ".join(f"{k} {v[-1]:.3f} s" for k, v in result.items())
        )
    for mngr, _, root in managers.values():
        mngr.close()
        shutil.rmtree(root)
    result["total"] = totals
    result["device_peak"] = device_peak
    return result


def _probe(contender, model, path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "_probe.py"), contender, model, str(path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"probe {contender} {model} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- reporting


def _med(xs):
    return statistics.median(xs)


def _table(name, r):
    nb = r["nbytes"]
    lines = [
        f"{r['label']}: {r['arrays']} arrays, {nb / GiB:.3f} GiB",
        f"  {'contender':17s} {'save s':>8s} {'GiB/s':>6s} {'restore s':>10s} "
        f"{'GiB/s':>6s} {'peak RSS':>9s} {'disk MiB':>9s}  verified",
    ]
    for c in r["save"]:
        s, t = _med(r["save"][c]), _med(r["restore"][c])
        p = r["rss"][c]
        ok = r["verified"].get(c)
        lines.append(
            f"  {c:17s} {s:8.3f} {nb / GiB / s:6.2f} {t:10.3f} {nb / GiB / t:6.2f} "
            f"{(p['peak'] - p['baseline']) / nb:8.2f}x {r['disk'][c] / 2**20:9.1f}  "
            + ("-" if ok is None else "yes" if ok else "NO")
        )
    floor = r.get("rss_floor")
    if floor:
        ours = r["rss"]["orbax_eqx"]
        least = floor["peak"] - floor["baseline"]
        lines.append(
            "  peak RSS of the arrays alone (made from filled host buffers, "
            f"nothing read): {least / nb:.2f}x; orbax_eqx / that: "
            f"{(ours['peak'] - ours['baseline']) / least:.2f}x"
        )
    a = r["async"]
    lines.append(
        f"  async: copy to host {_med(a['copy']):.3f} s, jax.device_get "
        f"{_med(a['device_get']):.3f} s, orbax_eqx's host copies "
        f"{_med(a['host_copies']):.3f} s; CheckpointManager.save blocks "
        + ", ".join(
            f"{n} {_med(a[n]):.3f} s (first {a[n][0]:.3f} s, total "
            f"{_med(a['total'][n]):.3f} s)"
            for n in ASYNC
            if n in a
        )
    )
    lines.append(
        "  device peak memory above the model's: save "
        + ", ".join(f"{n} {_mib(a['device_peak'].get(n))}" for n in ASYNC if n in a)
        + "; restore "
        + ", ".join(
            f"{c} {_mib(r['rss'][c].get('device_peak'))}"
            for c in r["rss"]
            if c in ASYNC
        )
    )
    lines.append(
        "  ratios (same run): "
        + ", ".join(
            f"orbax_eqx/{c} save {_ratio(r['save'], c):.2f}x"
            f" restore {_ratio(r['restore'], c):.2f}x"
            for c in r["save"]
            if c != "orbax_eqx"
        )
    )
    return "\n".join(lines)


def _mib(nbytes):
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def _ratio(times, other):
    return _med(times["orbax_eqx"]) / _med(times[other])


def _verdict(label, value, target, *, at_most):
    ok = value <= target if at_most else value >= target
    sign = "<=" if at_most else ">="
    if ok:
        by = ""
    elif at_most:
        by = f"  (missed: {value / target - 1:.0%} over)"
    else:
        by = f"  (missed: {1 - value / target:.0%} short)"
    verdict = "PASS" if ok else "FAIL"
    return f"  [{verdict}] {label}: {value:.2f} (target {sign} {target}){by}"


def targets(results):
    lines = ["Targets (medians, same-run ratios):"]
    for name, r in results.items():
        save, restore = r["save"], r["restore"]
        me = "orbax_eqx"
        tag = name
        if name in ("a", "c"):
            lines.append(
                _verdict(
                    f"({tag}) save time orbax_eqx / plain Orbax",
                    _med(save[me]) / _med(save["orbax"]),
                    1.0,
                    at_most=True,
                )
            )
            lines.append(
                _verdict(
                    f"({tag}) restore time orbax_eqx / plain Orbax",
                    _med(restore[me]) / _med(restore["orbax"]),
                    1.0,
                    at_most=True,
                )
            )
            lines.append(
                _verdict(
                    f"({tag}) save throughput / fsync'd raw write",
                    _med(save["raw"]) / _med(save[me]),
                    0.8,
                    at_most=False,
                )
            )
        if name == "b":
            lines.append(
                _verdict(
                    "(b) save speed-up over plain Orbax",
                    _med(save["orbax"]) / _med(save[me]),
                    5.0,
                    at_most=False,
                )
            )
            lines.append(
                _verdict(
                    "(b) restore speed-up over plain Orbax",
                    _med(restore["orbax"]) / _med(restore[me]),
                    5.0,
                    at_most=False,
                )
            )
    for name, r in results.items():
        a = r["async"]
        lines.append(
            _verdict(
                f"({name}) async: save() blocks / copy to host",
                _med(a[me]) / _med(a["copy"]),
                1.2,
                at_most=True,
            )
        )
        lines.append(
            _verdict(
                f"({name}) async: save() blocks / jax.device_get",
                _med(a[me]) / _med(a["device_get"]),
                0.5,
                at_most=True,
            )
        )
        lines.append(
            _verdict(
                f"({name}) async: its host copies alone / jax.device_get",
                _med(a["host_copies"]) / _med(a["device_get"]),
                0.5,
                at_most=True,
            )
        )
    for name, r in results.items():
        p = r["rss"][me]
        lines.append(
            _verdict(
                f"({name}) restore peak RSS / model bytes",
                (p["peak"] - p["baseline"]) / r["nbytes"],
                1.2,
                at_most=True,
            )
        )
    return "\n".join(lines)


def _machine():
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    device = jax.local_devices()[0]
    staging = os.environ.get("BENCHMARK_STAGING") or "auto"
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB RAM, {platform.system()} "
        f"{platform.release()}; backend {jax.default_backend()}, "
        f"{jax.local_device_count()} x {device.device_kind}; "
        f"Python {platform.python_version()}, jax "
        f"{jax.__version__}, orbax-checkpoint {getattr(ocp, '__version__', '?')}, "
        f"equinox {eqx.__version__}, orbax_eqx {orbax_eqx.__version__}; "
        f"staging {staging}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", action="store_true", help="also (c), ~2 GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="models to run, e.g. a,b")
    parser.add_argument(
        "--contenders", default=",".join(_contenders.CONTENDERS), help="subset"
    )
    parser.add_argument("--dir", default=None, help="where to write (local disk)")
    parser.add_argument("--warm", action="store_true", help="keep the page cache")
    parser.add_argument("--json", default=None, help="write all timings here")
    parser.add_argument(
        "--staging",
        choices=("auto", "copy"),
        default=None,
        help="copy: orbax_eqx restores pass max_staged_bytes, CPU devices copy",
    )
    args = parser.parse_args(argv)
    if args.staging is not None:
        os.environ["BENCHMARK_STAGING"] = args.staging  # probes inherit it
    models = args.only.split(",") if args.only else ["a", "b"] + ["c"] * args.big
    names = args.contenders.split(",")
    for needed in ("orbax_eqx", "orbax", "raw"):
        if needed not in names:
            names.append(needed)
    known = {**_contenders.CONTENDERS, **_contenders.EXTRA}
    contenders = [known[n]() for n in names]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="oeqx-bench-", dir=args.dir))
    print(_machine())
    print(f"writing to {workdir}; page cache {'kept' if args.warm else 'evicted'}")
    began = time.perf_counter()
    try:
        _warm_up(contenders, workdir)
        results = {m: bench_model(m, contenders, args, workdir) for m in models}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    for name, r in results.items():
        print(_table(name, r))
        print()
    print(targets(results))
    print(f"\n{args.repeats} repeats, {time.perf_counter() - began:.0f} s in all.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": _machine(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
