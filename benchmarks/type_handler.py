"""Save and restore time of Orbax's handler with the pack's type handler vs its default.

    python benchmarks/type_handler.py [--arrays 400] [--shape 64 32] [--repeats 3]

Saves a dict of `--arrays` small float32 arrays, each sharded P("x") over 8
fake CPU devices, with `ocp.PyTreeCheckpointHandler()` (Orbax's defaults:
its global `ArrayHandler`, OCDBT, zstd) and with
`ocp.PyTreeCheckpointHandler(type_handler_registry=oeqx.type_handler_registry())`,
through a synchronous `ocp.Checkpointer` (so a save's time includes every
write and the commit), then restores each onto the same sharding; prints the
median seconds of each and the ratios. Checks once that both restore the
saved values exactly. A benchmark, not a test: it prints.
"""

import os
import sys

# Before JAX starts: 8 fake CPU devices, whatever the caller's environment says.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import orbax_eqx as oeqx  # noqa: E402

CONTENDERS = {
    "orbax": "ocp.PyTreeCheckpointHandler() (Orbax's ArrayHandler)",
    "orbax_eqx": "ocp.PyTreeCheckpointHandler(type_handler_registry=oeqx...)",
}


def handler(name: str) -> ocp.PyTreeCheckpointHandler:
    if name == "orbax":
        return ocp.PyTreeCheckpointHandler()
    return ocp.PyTreeCheckpointHandler(
        type_handler_registry=oeqx.type_handler_registry()
    )


def make_tree(arrays: int, shape: tuple[int, ...], sharding) -> dict:
    rng = np.random.default_rng(0)
    tree = {}
    for i in range(arrays):
        host = rng.standard_normal(shape, dtype=np.float32)
        tree[f"layer{i:04d}"] = jax.make_array_from_callback(
            shape, sharding, lambda index, h=host: h[index]
        )
    return tree


def one_run(name: str, tree: dict, restore_args: dict, where: epath.Path):
    path = where / name
    if path.exists():
        shutil.rmtree(path)
    with ocp.Checkpointer(handler(name)) as ckptr:
        start = time.perf_counter()
        ckptr.save(path, args=ocp.args.PyTreeSave(tree))
        saved = time.perf_counter() - start
        start = time.perf_counter()
        restored = ckptr.restore(
            path, args=ocp.args.PyTreeRestore(restore_args=restore_args)
        )
        jax.block_until_ready(restored)
        loaded = time.perf_counter() - start
    return saved, loaded, restored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=400)
    parser.add_argument("--shape", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (a temp dir)")
    args = parser.parse_args()
    shape = tuple(args.shape)
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    tree = make_tree(args.arrays, shape, sharding)
    restore_args = {
        k: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=v.dtype)
        for k, v in tree.items()
    }
    where = epath.Path(args.dir or tempfile.mkdtemp(prefix="oeqx-typed-"))
    where.mkdir(parents=True, exist_ok=True)
    mib = args.arrays * np.prod(shape) * 4 / 2**20
    print(
        f"{args.arrays} arrays of float32{list(shape)} ({mib:.1f} MiB), P('x') "
        f"over {jax.device_count()} CPU devices; {args.repeats} run(s) each, "
        f"median seconds; in {where}"
    )
    times: dict[str, tuple[list[float], list[float]]] = {}
    for name in CONTENDERS:
        saves, loads = [], []
        for _ in range(args.repeats):
            saved, loaded, restored = one_run(name, tree, restore_args, where)
            saves.append(saved)
            loads.append(loaded)
        for key, x in tree.items():  # once per contender, after its runs
            got = restored[key]
            assert got.sharding == sharding, (name, key, got.sharding)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
        times[name] = (saves, loads)
    base_save = statistics.median(times["orbax"][0])
    base_load = statistics.median(times["orbax"][1])
    print(f"{'contender':<11} {'save s':>8} {'restore s':>10}   what")
    for name, (saves, loads) in times.items():
        save, load = statistics.median(saves), statistics.median(loads)
        print(f"{name:<11} {save:>8.3f} {load:>10.3f}   {CONTENDERS[name]}")
    save = statistics.median(times["orbax_eqx"][0])
    load = statistics.median(times["orbax_eqx"][1])
    print(
        f"orbax / orbax_eqx: save {base_save / save:.1f}x, "
        f"restore {base_load / load:.1f}x"
    )
    if args.dir is None:
        shutil.rmtree(where)


if __name__ == "__main__":
    main()
