"""What each process of a multi-process restore reads and holds.

    python benchmarks/restore_share.py [--blocks 96] [--code DIR] [--dir DIR]

Saves a deep model (`--blocks` blocks of `w1` (256, 1024) `P("fsdp")`, `wq`
(512, 512) `P("fsdp")`, `w2` (1024, 256) `P(None, "tp")`, a replicated norm:
96 blocks are 288 MiB, 385 arrays) with 2 processes x 4 CPU devices on a
(2, 4) mesh over ("fsdp", "tp") (stored chunks of 512 KiB and 256 KiB), then
restores it in fresh processes, 1, 2 and 4 of them, onto several meshes, and
prints per process the bytes it read (`/proc/self/io` rchar, the sidecar and
indexes included), the distinct bytes its devices hold, and its peak RSS
growth (`VmHWM` after resetting it through `/proc/self/clear_refs`), with
their ratios to what it holds. Every restored shard is checked bitwise.

`--code DIR` saves and restores with the `orbax_eqx` package under DIR (say,
`git archive` of another commit) instead of this checkout's: the baseline.
`(8,) one axis` maps both specs onto one axis (`P("x")`, `P(None, "x")`):
`w2`'s target boxes are then column strips of its stored chunks (with 8
processes, half a chunk's columns each: the rows that hold them are read).

Linux only. A benchmark, not a test: it prints.
"""

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from _proc import status as _status

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 900
MIB = 2**20

# (processes, target mesh): "AxB" over ("fsdp", "tp"); "8" one axis "x".
RESTORES = [
    (1, "2x4"),
    (1, "8x1"),
    (2, "2x4"),
    (2, "8x1"),
    (4, "8x1"),
    (4, "4x2"),
    (4, "2x4"),
    (4, "8"),
    (8, "8"),
]


def specs(blocks: int, target: str = "2x4"):
    from jax.sharding import PartitionSpec as P

    rows, cols = (P("x"), P(None, "x")) if target == "8" else (P("fsdp"), P(None, "tp"))
    out = {}
    for k in range(blocks):
        out[f"blocks_{k}_w1"] = ((256, 1024), rows)
        out[f"blocks_{k}_wq"] = ((512, 512), rows)
        out[f"blocks_{k}_w2"] = ((1024, 256), cols)
        out[f"blocks_{k}_norm"] = ((256,), P())
    return out


def values(i: int, shape):
    import numpy as np

    return np.random.default_rng(i).standard_normal(shape).astype(np.float32)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


def worker(args) -> None:
    import jax

    if args.processes > 1:
        address = f"127.0.0.1:{args.port}"
        jax.distributed.initialize(
            address,
            num_processes=args.processes,
            process_id=args.process_id,
            coordinator_bind_address=address,
            initialization_timeout=120,
        )
    import numpy as np
    from jax.sharding import NamedSharding

    import orbax_eqx as oeqx

    path = os.path.join(args.dir, "ckpt")
    target = "2x4" if args.way == "save" else args.way
    if target == "8":
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
    else:
        mesh = jax.make_mesh(tuple(int(n) for n in target.split("x")), ("fsdp", "tp"))
    table = specs(args.blocks, target)
    put = {n: NamedSharding(mesh, spec) for n, (_, spec) in table.items()}
    if args.way == "save":
        tree = {}
        for i, (name, (shape, _)) in enumerate(table.items()):
            full = values(i, shape)
            tree[name] = jax.make_array_from_callback(
                shape, put[name], lambda index, full=full: full[index]
            )
        oeqx.save(path, tree)
        print("RESULT {}", flush=True)
        return
    skeleton = {n: jax.ShapeDtypeStruct(s, np.float32) for n, (s, _) in table.items()}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss, rchar = _status("VmRSS"), _rchar()
    start = time.perf_counter()
    restored = oeqx.restore(path, skeleton, shardings=put)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - start
    read, peak = _rchar() - rchar, _status("VmHWM") - rss
    held = 0
    for i, name in enumerate(table):
        full, seen = values(i, table[name][0]), set()
        for shard in restored[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            box = tuple((s.start, s.stop) for s in shard.index)
            if box not in seen:
                seen.add(box)
                held += shard.data.nbytes
    model = sum(4 * int(np.prod(s)) for s, _ in table.values())
    result = {
        "process": jax.process_index(),
        "read": read,
        "held": held,
        "peak": peak,
        "model": model,
        "seconds": seconds,
    }
    print("RESULT " + json.dumps(result), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, code: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")
    }
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [code, env.get("PYTHONPATH", "")] if p
    )
    return env


def _run(way: str, opts, processes: int) -> list[dict]:
    port = _free_port()
    procs = []
    try:
        for i in range(processes):
            argv = [sys.executable, HERE, "--worker", way, "--dir", opts.dir]
            argv += ["--blocks", str(opts.blocks), "--processes", str(processes)]
            argv += ["--process-id", str(i), "--port", str(port)]
            procs.append(
                subprocess.Popen(
                    argv,
                    env=_env(8 // processes, opts.code),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        results = []
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            if p.returncode:
                raise SystemExit(f"{way} failed ({p.returncode}):\n{err[-4000:]}")
            line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
            results.append(json.loads(line[len("RESULT ") :]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: JAX swallows SIGTERM
                p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=96)
    parser.add_argument("--code", default=REPO_ROOT, help="where orbax_eqx is")
    parser.add_argument("--dir", help="where to save (default: a temporary dir)")
    parser.add_argument("--only", help="restores to run, e.g. 4:8x1,2:2x4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        opts.way = opts.worker
        worker(opts)
        return
    restores = RESTORES
    if opts.only:
        wanted = {tuple(x.split(":")) for x in opts.only.split(",")}
        restores = [(p, t) for p, t in RESTORES if (str(p), t) in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        opts.dir = opts.dir or tmp
        _run("save", opts, 2)
        print(f"code: {opts.code}; {opts.blocks} blocks, saved by 2 processes x 4")
        print(
            f"{'restore':<28} {'proc':>4} {'read MiB':>9} {'held MiB':>9} "
            f"{'read/held':>9} {'peak MiB':>9} {'peak/held':>9} {'time':>7}"
        )
        single = None
        for processes, target in restores:
            results = _run(target, opts, processes)
            mesh = (
                "(8,) one axis" if target == "8" else f"({target.replace('x', ', ')})"
            )
            label = f"{processes} x {8 // processes} dev onto {mesh}"
            for r in results:
                print(
                    f"{label:<28} {r['process']:>4} {r['read'] / MIB:>9.1f} "
                    f"{r['held'] / MIB:>9.1f} {r['read'] / r['held']:>8.2f}x "
                    f"{r['peak'] / MIB:>9.1f} {r['peak'] / r['held']:>8.2f}x "
                    f"{r['seconds']:>6.2f}s"
                )
            total = sum(r["read"] for r in results)
            if processes == 1 and single is None:
                single = total
            if single:
                print(
                    f"{'':<28} {'all':>4} {total / MIB:>9.1f} "
                    f"{sum(r['held'] for r in results) / MIB:>9.1f}   "
                    f"sum of reads / 1-process restore's: {total / single:.2f}x"
                )


if __name__ == "__main__":
    main()
