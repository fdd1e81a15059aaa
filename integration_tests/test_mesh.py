"""Save on one mesh, restore onto others: 8 fake CPU devices, each topology
in its own process (`_mesh_worker.py`).

Saved on a (4, 2) mesh, sharded by path rules (step 1) and replicated
(step 2); restored onto (2, 4) with shard boundaries that cut across the saved
chunks, onto (8,) sharded and fully replicated, and onto the one device of a
fresh 1-device process. The model holds a bfloat16 leaf, typed PRNG keys (one
sharded), an int32 leaf and shapes that divide over no mesh axis; every
restored value must equal the saved one exactly, shard by shard.
"""

import pytest

from . import _procs

WORKER = "_mesh_worker.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("mesh")
    root = base / "ckpt"
    logs = _procs.run(WORKER, "save", root, devices=8, log_dir=base / "logs")
    assert logs[0].rstrip().endswith("ok"), logs[0]
    return root


@pytest.mark.parametrize(
    "mode, devices",
    [("onto-2x4", 8), ("onto-8", 8), ("onto-1", 1)],
    ids=["mesh-2x4", "mesh-8", "one-device-process"],
)
def test_restore_onto_other_topology(saved, tmp_path, mode, devices):
    (log,) = _procs.run(WORKER, mode, saved, devices=devices, log_dir=tmp_path)
    assert log.rstrip().endswith("ok"), log
