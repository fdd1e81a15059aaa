"""Worker for test_deep_multihost.py: a deep LM over several JAX processes.

    python _deep_worker.py save ROOT BLOCKS       # every device: one ("x",) mesh
    python _deep_worker.py restore ROOT BLOCKS    # a (4, 2) mesh, or one device

`save` writes step 1 through a CheckpointManager with EqxHandler, every 2-D
weight sharded P("x") over all devices of all processes (the set-up that
used to hang from 16 blocks on). `restore` restores it onto a ("a", "b")
mesh of every device (2-D weights P("a", "b"), so shard boundaries cut
across the saved chunks), or, in one process with one device, onto that
device; every shard is compared bitwise with values regenerated here.
`_procs.run` appends `--process-id`, `--processes` and `--port`. Prints `ok`.
"""

import sys
import time
from pathlib import Path

from _worker import start

args = start("mode", "root", "blocks")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

ROOT = Path(args.root)
DIM = 16


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    norm2: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(2, DIM, key=k1)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.mlp = eqx.nn.MLP(DIM, DIM, 4 * DIM, 1, key=k2)
        self.norm2 = eqx.nn.LayerNorm(DIM)


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    head: eqx.nn.Linear

    def __init__(self, blocks, key):
        keys = jax.random.split(key, blocks + 2)
        self.embed = eqx.nn.Embedding(64, DIM, key=keys[0])
        self.blocks = [Block(k) for k in keys[2:]]
        self.head = eqx.nn.Linear(DIM, 64, key=keys[1])


def shapes():
    return eqx.filter_eval_shape(LM, int(args.blocks), jax.random.key(0))


def values():
    """The saved values, the same in every process: from numpy, not eager JAX
    (which compiles every initialiser, seconds per process here)."""
    rng = np.random.default_rng(7)
    return jtu.tree_map(
        lambda x: (
            rng.standard_normal(x.shape).astype(x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        shapes(),
    )


def spec(x, two_d):
    return two_d if x.ndim == 2 and x.shape[0] % 8 == 0 else P()


def place(tree, mesh, two_d):
    def put(x):
        if not isinstance(x, np.ndarray):
            return x
        sharding = NamedSharding(mesh, spec(x, two_d))
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    return jtu.tree_map(put, tree)


def save():
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    model = place(values(), mesh, P("x"))
    arrays = [x for x in jtu.tree_leaves(model) if isinstance(x, jax.Array)]
    sharded = [x for x in arrays if not x.is_fully_replicated]
    assert len(sharded) == 6 * int(args.blocks) + 2, len(sharded)
    mngr = ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler())
    began = time.perf_counter()
    mngr.save(1, args=oeqx.EqxSave(model))
    mngr.wait_until_finished()
    print(f"saved {len(sharded)} sharded arrays in {time.perf_counter() - began:.1f} s")
    mngr.close()


def restore():
    if jax.device_count() == 1:
        device = SingleDeviceSharding(jax.devices()[0])

        def target(x):
            return device
    else:
        mesh = jax.make_mesh((4, jax.device_count() // 4), ("a", "b"))

        def target(x):
            return NamedSharding(mesh, spec(x, P("a", "b")))

    want = values()
    shardings = jtu.tree_map(
        lambda x: target(x) if isinstance(x, np.ndarray) else None, want
    )
    skeleton = eqx.filter_eval_shape(LM, int(args.blocks), jax.random.key(99))
    mngr = ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler())
    restored = mngr.restore(1, args=oeqx.EqxRestore(skeleton, shardings=shardings))
    mngr.close()
    pairs = [
        (x, full)
        for x, full in zip(
            jtu.tree_leaves(restored), jtu.tree_leaves(want), strict=True
        )
        if isinstance(full, np.ndarray)
    ]
    assert len(pairs) == 12 * int(args.blocks) + 3, len(pairs)
    for x, full in pairs:
        assert x.sharding.is_equivalent_to(target(full), x.ndim), x.sharding
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), full[shard.index], strict=True
            )
    print(f"restored {len(pairs)} arrays, every shard equal")


if __name__ == "__main__":
    {"save": save, "restore": restore}[args.mode]()
    print("ok", flush=True)
    sys.exit(0)
