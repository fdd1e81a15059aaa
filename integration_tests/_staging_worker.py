"""Worker for test_staging_hosts.py: staged restores, several JAX processes.

    python _staging_worker.py save ROOT       # one ("x",) mesh of every device
    python _staging_worker.py restore ROOT    # onto a ("a", "b") mesh

`save` writes step 1 through a CheckpointManager: a 16 MiB and a 4 MiB array
sharded over every device of every process, a replicated (packed) table, and
100 small sharded arrays. `restore` reads them through an 8 MiB window
(`max_staged_bytes`, which CPU devices copy through as accelerators do) onto
shardings that cut across the saved chunks: the 16 MiB array replicated on
every device (each device's box is larger than the window: streamed), the
table split over both processes' devices (a packed leaf onto a sharding no
process holds whole), and compares every shard with values regenerated
here; it prints the peak of host allocations during the restore
(tracemalloc: staging buffers are numpy's) and whether the arrays are XLA's
copies (a donation reuses only a buffer XLA owns). `_procs.run` appends
`--process-id`, `--processes` and `--port`. Prints `ok`.
"""

import json
import sys
import tracemalloc
from pathlib import Path

from _worker import start

args = start("mode", "root")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

ROOT = Path(args.root)
WINDOW = 8 << 20


def values():
    rng = np.random.default_rng(11)
    return {
        "big": rng.standard_normal((4096, 1024)).astype(np.float32),
        "rows": rng.standard_normal((2048, 512)).astype(np.float32),
        "table": rng.standard_normal((512, 512)).astype(np.float32),
        "small": [np.full((16, 8), i, np.float32) for i in range(100)],
    }


def place(tree, specs, mesh):
    def put(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    return {
        name: [put(x, specs[name]) for x in v]
        if isinstance(v, list)
        else put(v, specs[name])
        for name, v in tree.items()
    }


def save():
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    specs = {"big": P("x"), "rows": P("x"), "table": P(), "small": P("x")}
    item = place(values(), specs, mesh)
    mngr = ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler())
    mngr.save(1, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    mngr.close()


def restore():
    mesh = jax.make_mesh((4, jax.device_count() // 4), ("a", "b"))
    specs = {"big": P(), "rows": P("b", "a"), "table": P("a"), "small": P("b")}
    shardings = {
        name: [NamedSharding(mesh, specs[name])] * 100
        if name == "small"
        else NamedSharding(mesh, specs[name])
        for name in specs
    }
    want = values()
    skeleton = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), want)
    mngr = ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler())
    restore_args = oeqx.EqxRestore(
        skeleton, shardings=shardings, max_staged_bytes=WINDOW
    )
    tracemalloc.start()
    restored = jax.block_until_ready(mngr.restore(1, args=restore_args))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    mngr.close()
    flat_want = jax.tree.leaves(want)
    flat_shardings = jax.tree.leaves(shardings)
    for x, full, sharding in zip(
        jax.tree.leaves(restored), flat_want, flat_shardings, strict=True
    ):
        assert x.sharding.is_equivalent_to(sharding, x.ndim), x.sharding
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), full[shard.index], strict=True
            )
    big = restored["big"]
    before = [s.data.unsafe_buffer_pointer() for s in big.addressable_shards]
    donated = jax.jit(lambda x: x * 1, donate_argnums=0)(big)
    after = [s.data.unsafe_buffer_pointer() for s in donated.addressable_shards]
    print(json.dumps({"peak": peak, "copied": after == before}))


if __name__ == "__main__":
    {"save": save, "restore": restore}[args.mode]()
    print("ok", flush=True)
    sys.exit(0)
