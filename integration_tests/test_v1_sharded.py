"""Orbax's v1 API with sharded Equinox modules: 8 fake CPU devices.

Saved sharded on a (4, 2) mesh through `ocp.training.Checkpointer` and
`ocp.save_checkpointables` (`_v1_sharded_worker.py save`), restored through
v1 onto a (2, 4) mesh whose shard boundaries cut across the saved chunks, and
onto the one device of a fresh 1-device process, where orbax_eqx's own
`restore` and `verify` read the same files. Each topology is its own process.
"""

import pytest

from . import _procs

WORKER = "_v1_sharded_worker.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("v1_sharded")
    root = base / "ckpt"
    (log,) = _procs.run(WORKER, "save", root, devices=8, log_dir=base / "logs")
    assert log.rstrip().endswith("ok"), log
    return root


@pytest.mark.parametrize(
    "mode, devices",
    [("onto-2x4", 8), ("onto-1", 1)],
    ids=["mesh-2x4", "one-device-process"],
)
def test_v1_sharded_restore_onto_other_topology(saved, tmp_path, mode, devices):
    (log,) = _procs.run(WORKER, mode, saved, devices=devices, log_dir=tmp_path)
    assert log.rstrip().endswith("ok"), log
