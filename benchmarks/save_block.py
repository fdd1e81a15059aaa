"""How long `CheckpointManager.save` blocks, on 1 device and on 8 devices.

    python benchmarks/save_block.py [--model b] [--repeats 5] [--profile N]

Model (b) (6,313 arrays: a deep model and its Adam state), saved by a
`CheckpointManager` with async checkpointing (orbax_eqx's `EqxHandler`): on 1
CPU device (unsharded, packed), then in a fresh process on 8 CPU devices,
every array whose leading dimension divides by 8 sharded `P("fsdp")` and
the rest replicated, as `benchmarks/sharded.py` places them. Each process
saves once to warm up (the first save of a tree structure walks it before
returning), then `--repeats` times; the figure is the median time from the
call to its return. After every save the arrays are donated to a jitted
function at once (as a training step would) and the step is restored and
compared with what was saved. Target: 8 devices <= 2x 1 device.
`--profile N` prints the top N functions of a cProfile of one 8-device save.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def probe(devices: int, model: str, repeats: int, profile: int) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    sys.path[:0] = [str(ROOT), str(HERE)]
    import _models
    import equinox as eqx
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import orbax_eqx as oeqx

    mesh = jax.make_mesh((devices,), ("fsdp",))

    def place(x):
        if not eqx.is_array(x):
            return x
        spec = P("fsdp") if x.ndim and x.shape[0] % devices == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    def fresh():
        # New arrays each time, as a training step gives: nothing cached.
        return jax.block_until_ready(
            jax.tree_util.tree_map(place, _models.build(model))
        )

    donate = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)
    blocked, shards = [], 0
    with (
        tempfile.TemporaryDirectory() as root,
        ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler()) as mngr,
    ):
        for step in range(repeats + 1):
            item = fresh()
            expected = jax.tree_util.tree_map(
                lambda x: np.array(x, copy=True) if eqx.is_array(x) else x, item
            )
            skeleton = jax.tree_util.tree_map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if eqx.is_array(x)
                    else x
                ),
                item,
            )
            arrays = [x for x in jax.tree_util.tree_leaves(item) if eqx.is_array(x)]
            shards = sum(len(x.addressable_shards) for x in arrays)
            if profile and step == repeats:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
            start = time.perf_counter()
            mngr.save(step, args=oeqx.EqxSave(item))
            seconds = time.perf_counter() - start
            if profile and step == repeats:
                prof.disable()
                pstats.Stats(prof, stream=sys.stderr).sort_stats(
                    "cumulative"
                ).print_stats(profile)
            # Donated at once: the save must hold what it needs already.
            jax.block_until_ready([donate(x) for x in arrays])
            mngr.wait_until_finished()
            if step:
                blocked.append(seconds)
            restored = mngr.restore(step, args=oeqx.EqxRestore(skeleton))
            same = all(
                np.array_equal(np.asarray(a), b)
                for a, b in zip(
                    jax.tree_util.tree_leaves(restored),
                    jax.tree_util.tree_leaves(expected),
                    strict=True,
                )
            )
            if not same:
                raise SystemExit(f"step {step}: restored values differ")
    return {
        "devices": devices,
        "arrays": len(arrays),
        "shards": shards,
        "blocked": blocked,
        "median": statistics.median(blocked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.model, args.repeats, args.profile)))
        return
    from importlib.metadata import version

    print(
        f"Configuration: backend CPU, model ({args.model}), CheckpointManager "
        f"async save with EqxHandler; 1 device unsharded, 8 devices P('fsdp'); "
        f"medians of {args.repeats} after one warm-up save; {os.cpu_count()} "
        f"CPUs, load average {os.getloadavg()[0]:.2f}; Python "
        f"{sys.version.split()[0]}, jax {version('jax')}, orbax-checkpoint "
        f"{version('orbax-checkpoint')}"
    )
    rows = {}
    for devices in (1, 8):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--probe",
                str(devices),
                "--model",
                args.model,
                "--repeats",
                str(args.repeats),
                "--profile",
                str(args.profile if devices == 8 else 0),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode:
            print(done.stdout, done.stderr)
            raise SystemExit(f"the {devices}-device probe failed")
        if args.profile and devices == 8:
            print(done.stderr[-20000:])
        rows[devices] = json.loads(done.stdout.strip().splitlines()[-1])
        r = rows[devices]
        print(
            f"  {devices} device(s): {r['arrays']} arrays, {r['shards']} shards; "
            f"save() blocks {r['median']:.3f} s (each: "
            f"{', '.join(f'{t:.3f}' for t in r['blocked'])}); donated after "
            "each save, restores equal"
        )
    ratio = rows[8]["median"] / rows[1]["median"]
    print(
        f"  [{'PASS' if ratio <= 2 else 'FAIL'}] 8 devices / 1 device: "
        f"{ratio:.2f}x (target <= 2x)"
    )


if __name__ == "__main__":
    main()
