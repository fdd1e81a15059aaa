"""Peak host memory of a sharded restore, against the model's size.

    python benchmarks/sharded_restore_memory.py [--mib 256] [--dir DIR]

Saves a model of `--mib` MiB (float32 `eqx.nn.Linear` layers) sharded over 8
fake CPU devices, then restores it in fresh processes, each way below, and
prints the peak resident memory each process gained during the restore
(`VmHWM` after resetting it through /proc/self/clear_refs, minus `VmRSS`
before), next to the model's bytes. On CPU the restored arrays live in host
memory, so a process that holds a whole model cannot go below 1.00x; one
that holds half (2 processes x 4 devices) should be near 0.50x: each process
reads only what its own devices need.

Linux only (reads /proc/self/status). A benchmark, not a test: it prints. The plain
Orbax way imports `orbax_eqx._tree.names` and `_tree.walk` (private) for the keys
orbax_eqx stored its arrays under, which plain Orbax then restores.
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

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
LAYERS = 16
TIMEOUT_S = 600

WAYS = {
    "sharded-8": "orbax_eqx onto a (8,) mesh, P('x'), 1 process",
    "bounded-8": "  the same, EqxHandler(restore_concurrent_gb=0.05)",
    "sharded-2x4": "orbax_eqx onto 2 processes x 4 devices (per process)",
    "plain-orbax-8": "plain Orbax PyTreeCheckpointHandler, (8,) mesh, P('x')",
    "one-device": "orbax_eqx onto 1 device (whole arrays)",
    "whole-then-shard": "whole arrays on 1 device, then device_put sharded",
}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------- worker


def _model_shape(width: int):
    import equinox as eqx
    import jax

    def make(key):
        keys = jax.random.split(key, LAYERS)
        return eqx.nn.Sequential([eqx.nn.Linear(4 * width, width, key=k) for k in keys])

    return eqx.filter_eval_shape(make, jax.random.key(0))


def _width(mib: int) -> int:
    # One layer: (width, 4 * width) weights + width biases, float32.
    per_layer = mib * 2**20 // LAYERS
    width = int((per_layer / 16) ** 0.5) // 8 * 8
    return max(width, 8)


def _shardings(mesh):
    """`(name, leaf) -> Sharding`: every array split along its first axis."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharded = NamedSharding(mesh, P("x"))
    return lambda name, leaf: sharded


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
    import jax.tree_util as jtu
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    import orbax_eqx as oeqx

    path = os.path.join(args.dir, "ckpt")
    skeleton = _model_shape(_width(args.mib))
    nbytes = sum(x.size * x.dtype.itemsize for x in jtu.tree_leaves(skeleton))

    if args.way == "save":
        rng = np.random.default_rng(0)
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
        pick = _shardings(mesh)

        def fill(x):
            full = rng.standard_normal(x.shape, dtype=np.float32)
            return jax.make_array_from_callback(
                x.shape, pick(None, x), lambda i: full[i]
            )

        model = jtu.tree_map(fill, skeleton)
        oeqx.save(path, model, overwrite=True)
        print(json.dumps({"nbytes": nbytes}))
        return

    if args.way == "one-device":
        shardings = None
    else:
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
        shardings = _shardings(mesh)

    gc.collect()
    exact = reset_peak()
    before = status_kib("VmRSS")
    start = time.perf_counter()
    if args.way == "plain-orbax-8":
        from orbax_eqx._tree.names import storage_key  # the keys orbax_eqx stored under
        from orbax_eqx._tree.walk import walk

        leaves = walk(skeleton).leaves
        item = {
            storage_key(leaf.name): jax.ShapeDtypeStruct(
                leaf.value.shape,
                leaf.value.dtype,
                sharding=shardings(leaf.name, leaf.value),
            )
            for leaf in leaves
            if leaf.kind == "array"
        }
        restore_args = {
            k: ocp.ArrayRestoreArgs(sharding=v.sharding) for k, v in item.items()
        }
        handler = ocp.PyTreeCheckpointHandler()
        restored = handler.restore(
            epath.Path(path),
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args),
        )
        handler.close()
    elif args.way == "whole-then-shard":
        whole = oeqx.restore(path, skeleton)
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
        pick = _shardings(mesh)
        restored = jtu.tree_map(lambda x: jax.device_put(x, pick(None, x)), whole)
        jax.block_until_ready(restored)
        del whole
    elif args.way == "bounded-8":
        # At most ~50 MB of array data in flight: less transient memory.
        handler = oeqx.EqxHandler(restore_concurrent_gb=0.05)
        restored = handler.restore(
            epath.Path(path), args=oeqx.EqxRestore(skeleton, shardings=shardings)
        )
        handler.close()
    else:
        restored = oeqx.restore(path, skeleton, shardings=shardings)
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    held = sum(
        shard.data.nbytes
        for x in jtu.tree_leaves(restored)
        for shard in x.addressable_shards
    )
    print(
        json.dumps(
            {
                "nbytes": nbytes,
                "gained": (peak - before) * 1024,
                "held": held,
                "seconds": seconds,
                "exact_peak": exact,
                "process": jax.process_index(),
            }
        )
    )


# --------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={devices}"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [REPO_ROOT, env.get("PYTHONPATH", "")] if p
    )
    return env


def _run(way: str, opts, processes: int = 1, devices: int = 8) -> list[dict]:
    port = _free_port()
    procs = []
    try:
        for i in range(processes):
            argv = [sys.executable, HERE, "--worker", way, "--mib", str(opts.mib)]
            argv += ["--dir", opts.dir, "--processes", str(processes)]
            argv += ["--process-id", str(i), "--port", str(port)]
            procs.append(
                subprocess.Popen(
                    argv,
                    env=_env(devices),
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
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB")
    parser.add_argument("--dir", help="where to save (default: a temporary dir)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        opts.way = opts.worker
        worker(opts)
        return
    with tempfile.TemporaryDirectory() as tmp:
        opts.dir = opts.dir or tmp
        (saved,) = _run("save", opts)
        model = saved["nbytes"]
        print(
            f"model: {model / 2**20:.1f} MiB float32 in {2 * LAYERS} arrays, saved "
            "sharded over 8 fake CPU devices (zstd, OCDBT)"
        )
        print(
            f"{'restore':<66} {'peak gain':>10} {'/ model':>8} {'held':>8} {'time':>7}"
        )
        for way, label in WAYS.items():
            if way == "sharded-2x4":
                results = _run(way, opts, processes=2, devices=4)
            else:
                results = _run(way, opts, devices=1 if way == "one-device" else 8)
            for r in results:
                who = f" [process {r['process']}]" if len(results) > 1 else ""
                mark = "" if r["exact_peak"] else " (peak not reset: upper bound)"
                print(
                    f"{label + who:<66} {r['gained'] / 2**20:>7.0f} MiB "
                    f"{r['gained'] / model:>7.2f}x {r['held'] / model:>7.2f}x "
                    f"{r['seconds']:>6.2f}s{mark}"
                )


if __name__ == "__main__":
    main()
