"""Worker for test_mesh.py: one topology per process (8 or 1 fake CPU devices).

    python _mesh_worker.py save ROOT         # 8 devices, (4, 2) mesh
    python _mesh_worker.py onto-2x4 ROOT     # 8 devices, (2, 4) mesh
    python _mesh_worker.py onto-8 ROOT       # 8 devices, (8,) mesh
    python _mesh_worker.py onto-1 ROOT       # 1 device

ROOT is a CheckpointManager root. `save` writes step 1 sharded by
`_net.SAVE_RULES` and step 2 replicated, plus ROOT/../fingerprints.json: the
digest of every saved value, which the restoring processes check their own
copy of the expected values against. Prints `ok` last.
"""

import json
import sys
from pathlib import Path

from _worker import start

args = start("mode", "root")

import _net  # noqa: E402
import jax  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from orbax_eqx._tree.walk import walk  # noqa: E402

ROOT = Path(args.root)
FINGERPRINTS = ROOT.parent / "fingerprints.json"
STEPS = (1, 2)


def manager():
    return ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler())


def expected(step):
    """This process's own copy of the item saved at `step`, checked against the
    digests the saving process wrote."""
    item = _net.saved_item(step)
    saved = json.loads(FINGERPRINTS.read_text())[str(step)]
    assert _net.fingerprint(item) == saved, "expected values differ from saved ones"
    return item


def save():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = _net.rules(mesh, _net.SAVE_RULES)
    replicated = NamedSharding(mesh, P())
    placements = {1: sharded, 2: lambda name, leaf: replicated}
    mngr = manager()
    for step in STEPS:
        local = _net.saved_item(step)
        item = _net.globalize(local, placements[step])
        _net.check_restored(item, local, placements[step])
        assert mngr.save(step, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    assert mngr.all_steps() == list(STEPS)
    mngr.close()
    prints = {step: _net.fingerprint(_net.saved_item(step)) for step in STEPS}
    FINGERPRINTS.write_text(json.dumps(prints))


def onto_2x4():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = _net.rules(mesh, _net.RESTORE_RULES_2D)
    mngr = manager()
    for step in STEPS:  # sharded -> resharded, replicated -> sharded
        restored = mngr.restore(
            step, args=oeqx.EqxRestore(_net.skeleton(), shardings=shardings)
        )
        _net.check_restored(restored, expected(step), shardings)
    mngr.close()

    # The same placement given as the skeleton's own shardings, and as a tree.
    skeleton = _net.skeleton()
    walked = walk(skeleton)
    placed = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings(leaf.name, x))
        if isinstance(x := leaf.value, jax.ShapeDtypeStruct)
        else x
        for leaf in walked.leaves
    ]
    tree = [
        shardings(leaf.name, leaf.value)
        if isinstance(leaf.value, jax.ShapeDtypeStruct)
        else None
        for leaf in walked.leaves
    ]
    restored = oeqx.restore(ROOT / "1", jtu.tree_unflatten(walked.treedef, placed))
    _net.check_restored(restored, expected(1), shardings)
    restored = oeqx.restore(
        ROOT / "1", skeleton, shardings=jtu.tree_unflatten(walked.treedef, tree)
    )
    _net.check_restored(restored, expected(1), shardings)

    # The README's example rules, verbatim.
    readme = oeqx.shardings_from_rules(
        mesh,
        [
            (r"\.attn\..*\.weight$", P(None, "model")),
            (r"embed", P("model", None)),
            (r".*", P()),  # everything else: replicated
        ],
    )
    restored = oeqx.restore(ROOT / "1", skeleton, shardings=readme)
    _net.check_restored(restored, expected(1), readme)
    spec = restored["model"].blocks[1].attn.value_proj.weight.sharding.spec
    assert spec == P(None, "model"), spec

    # Dimensions that do not divide over the mesh are named before any read.
    uneven = _net.rules(
        mesh,
        [(r"head\.bias$", P("model")), (r"\.odd$", P(None, "data")), (r".*", P())],
    )
    try:
        oeqx.restore(ROOT / "1", skeleton, shardings=uneven)
    except oeqx.CheckpointMismatchError as e:
        message = str(e)
        print(message)
        assert (
            "  - Leaf `model.head.bias` has shape (7,): dimension 0 (size 7) does "
            "not divide evenly over mesh axis 'model' (4), as rule 0 "
            "(r'head\\.bias$', P('model',)) asks." in message
        ), message
        assert (
            "  - Leaf `model.odd` has shape (5, 3): dimension 1 (size 3) does not "
            "divide evenly over mesh axis 'data' (2)" in message
        ), message
        assert "JAX shards a dimension only into equal parts" in message
    else:
        raise AssertionError("uneven rules restored")


def onto_8():
    mesh = jax.make_mesh((8,), ("x",))
    shardings = _net.rules(mesh, _net.RESTORE_RULES_1D)
    replicated = NamedSharding(mesh, P())
    for step in STEPS:
        restored = oeqx.restore(ROOT / str(step), _net.skeleton(), shardings=shardings)
        _net.check_restored(restored, expected(step), shardings)
        # Sharded -> replicated on all 8 devices, with one Sharding for all.
        restored = oeqx.restore(ROOT / str(step), _net.skeleton(), shardings=replicated)
        _net.check_restored(restored, expected(step), lambda n, x: replicated)


def onto_1():
    assert jax.device_count() == 1
    device = SingleDeviceSharding(jax.devices()[0])
    mngr = manager()
    for step in STEPS:
        # No shardings anywhere: the one local device.
        restored = mngr.restore(step, args=oeqx.EqxRestore(_net.skeleton()))
        _net.check_restored(restored, expected(step), lambda n, x: device)
    mngr.close()
    flat = oeqx.restore(ROOT / "1")  # no skeleton either
    assert flat["step"] == 1
    assert flat["model.scale"].dtype == "bfloat16"


MODES = {"save": save, "onto-2x4": onto_2x4, "onto-8": onto_8, "onto-1": onto_1}

if __name__ == "__main__":
    MODES[args.mode]()
    print("ok", flush=True)
    sys.exit(0)
