"""Worker for test_dedup_sharded.py: one JAX process of a `jax.distributed`
group (2 processes x 4 CPU devices).

    python _dedup_sharded_worker.py save ROOT

Saves a frozen sharded base beside a trained sharded head through a
CheckpointManager with `EqxHandler(dedup=True)`, 4 times; process 0 writes
ROOT/../shared-sizes.json (the files new in the shared directory after each
save). Then every process restores every step, over the save's mesh and over
another, and checks each of its shards bitwise. Prints `ok` last.
"""

import json
import os
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
SHARED = ROOT / "orbax_eqx~shared"
STEPS = 4
SPECS = {"w": P("a", "b"), "emb": P("a"), "head": P("a")}


def values(step: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((64, 1024)).astype(np.float32),
        "emb": rng.standard_normal((256, 64)).astype(np.float32),
        "head": np.full((8, 64), step, np.float32) + np.arange(64, dtype=np.float32),
    }


def item(step: int, mesh) -> dict:
    def put(name, x):
        sharding = NamedSharding(mesh, SPECS[name])
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    placed = {k: put(k, v) for k, v in values(step).items()}
    return {"base": {"w": placed["w"], "emb": placed["emb"]}, "head": placed["head"]}


def skeleton(mesh) -> dict:
    def struct(name, x):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, SPECS[name])
        )

    s = {k: struct(k, v) for k, v in values(0).items()}
    return {"base": {"w": s["w"], "emb": s["emb"]}, "head": s["head"]}


def check(got: dict, step: int) -> None:
    want = values(step)
    flat = {"w": got["base"]["w"], "emb": got["base"]["emb"], "head": got["head"]}
    for name, x in flat.items():
        assert x.addressable_shards, name
        for shard in x.addressable_shards:
            expected = want[name][shard.index]
            assert np.array_equal(np.asarray(shard.data), expected), (step, name)


mesh = jax.make_mesh((4, 2), ("a", "b"))
sizes = []
with ocp.CheckpointManager(
    ROOT,
    item_handlers=oeqx.EqxHandler(dedup=True),
    options=ocp.CheckpointManagerOptions(max_to_keep=3),
) as mngr:
    for step in range(STEPS):
        before = set(os.listdir(SHARED)) if SHARED.exists() else set()
        mngr.save(step, args=oeqx.EqxSave(item(step, mesh)))
        mngr.wait_until_finished()
        sizes.append(
            {
                n: os.path.getsize(SHARED / n)
                for n in os.listdir(SHARED)
                if n not in before
            }
        )
    if jax.process_index() == 0:
        (ROOT.parent / "shared-sizes.json").write_text(json.dumps(sizes))
    other = jax.make_mesh((2, 4), ("a", "b"))
    for step in mngr.all_steps():
        check(mngr.restore(step, args=oeqx.EqxRestore(skeleton(mesh))), step)
        check(mngr.restore(step, args=oeqx.EqxRestore(skeleton(other))), step)
    print("steps", mngr.all_steps(), flush=True)
print("ok", flush=True)
