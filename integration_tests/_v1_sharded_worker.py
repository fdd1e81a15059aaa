"""Worker for test_v1_sharded.py: Orbax's v1 API, one topology per process.

    python _v1_sharded_worker.py save ROOT       # 8 devices, (4, 2) mesh
    python _v1_sharded_worker.py onto-2x4 ROOT   # 8 devices, (2, 4) mesh
    python _v1_sharded_worker.py onto-1 ROOT     # 1 device

`save` writes `_net`'s item, sharded by `_net.SAVE_RULES`, as the
checkpointable `train` twice: step 1 of an `ocp.training.Checkpointer` at
ROOT (Orbax's v0 machinery underneath) and a checkpoint of its own at
ROOT/../free (`ocp.save_checkpointables`), plus ROOT/../fingerprints.json for
the restoring processes. Nothing but the import of orbax_eqx sets Orbax up.
Prints `ok` last.
"""

import json
import sys
from pathlib import Path

from _worker import start

args = start("mode", "root")

import _net  # noqa: E402
import jax  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402
from orbax.checkpoint import v1 as ocp  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from orbax_eqx._tree.walk import walk  # noqa: E402

ROOT = Path(args.root)
FREE = ROOT.parent / "free"
FINGERPRINTS = ROOT.parent / "fingerprints.json"
STEP = 1


def expected():
    item = _net.saved_item(STEP)
    saved = json.loads(FINGERPRINTS.read_text())
    assert _net.fingerprint(item) == saved, "expected values differ from saved ones"
    return item


def save():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = _net.rules(mesh, _net.SAVE_RULES)
    local = _net.saved_item(STEP)
    item = _net.globalize(local, sharded)
    _net.check_restored(item, local, sharded)
    assert item["model"].embed.weight.sharding.num_devices == 8
    with ocp.training.Checkpointer(ROOT) as ckptr:
        assert ckptr.save_checkpointables(STEP, {"train": item})
    ocp.save_checkpointables(FREE, {"train": item})
    FINGERPRINTS.write_text(json.dumps(_net.fingerprint(local)))


def _placed_skeleton(shardings):
    """The skeleton with each array's target sharding on its `ShapeDtypeStruct`."""
    walked = walk(_net.skeleton())
    leaves = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings(leaf.name, x))
        if isinstance(x := leaf.value, jax.ShapeDtypeStruct)
        else x
        for leaf in walked.leaves
    ]
    return jtu.tree_unflatten(walked.treedef, leaves)


def onto_2x4():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = _net.rules(mesh, _net.RESTORE_RULES_2D)
    want = expected()
    abstract = {"train": oeqx.EqxRestore(_net.skeleton(), shardings=shardings)}
    with ocp.training.Checkpointer(ROOT) as ckptr:
        restored = ckptr.load_checkpointables(STEP, abstract)["train"]
    _net.check_restored(restored, want, shardings)
    # A bare skeleton whose structs carry the shardings: Orbax's v1 layer maps
    # over abstract checkpointables before a handler sees them.
    restored = ocp.load_checkpointables(FREE, {"train": _placed_skeleton(shardings)})
    _net.check_restored(restored["train"], want, shardings)


def onto_1():
    assert jax.device_count() == 1
    device = SingleDeviceSharding(jax.devices()[0])
    want = expected()
    with ocp.training.Checkpointer(ROOT) as ckptr:
        restored = ckptr.load_checkpointables(STEP, {"train": _net.skeleton()})
    _net.check_restored(restored["train"], want, lambda n, x: device)
    # The same files through orbax_eqx's own API and its checker.
    restored = oeqx.restore(FREE / "train", _net.skeleton())
    _net.check_restored(restored, want, lambda n, x: device)
    for path in (ROOT / str(STEP) / "train", FREE / "train"):
        report = oeqx.verify(path)
        assert report.ok and len(report.checked) == _net.ARRAY_LEAVES, report


MODES = {"save": save, "onto-2x4": onto_2x4, "onto-1": onto_1}

if __name__ == "__main__":
    MODES[args.mode]()
    print("ok", flush=True)
    sys.exit(0)
