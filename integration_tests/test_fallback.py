"""Falling back to the newest step that restores cleanly."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx


def _item(step):
    return {"w": jnp.full((64, 64), float(step)), "step": step}


SKELETON = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "step": 0}


def _manager(root):
    return ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())


@pytest.fixture
def root(tmp_path):
    mngr = _manager(tmp_path)
    for step in (1, 2, 3):
        mngr.save(step, args=oeqx.EqxSave(_item(step)))
    mngr.wait_until_finished()
    mngr.close()
    return tmp_path


def _data_files(item_dir):
    """Array data: the pack file, and any data files of Orbax's own store."""
    return [
        p
        for p in item_dir.rglob("*")
        if p.is_file() and ("/d/" in str(p) or p.name.startswith("orbax_eqx~packed"))
    ]


def test_latest_step_restores_without_warning(root):
    step, item = oeqx.restore_latest(_manager(root), oeqx.EqxRestore(SKELETON))
    assert step == 3 and item["step"] == 3


@pytest.mark.parametrize("damage", ["sidecar_deleted", "data_deleted", "truncated"])
def test_damaged_newest_step_falls_back(root, damage):
    item_dir = root / "3" / "default"
    if damage == "sidecar_deleted":
        (item_dir / "orbax_eqx.json").unlink()
    else:
        for f in _data_files(item_dir):
            if damage == "data_deleted":
                f.unlink()
            else:
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    mngr = _manager(root)
    with pytest.warns(
        oeqx.OrbaxEqxWarning,
        match=r"(?s)Restored step 2 of .*, because newer steps could not be "
        r"restored:\n  - step 3: ",
    ):
        step, item = oeqx.restore_latest(mngr, oeqx.EqxRestore(SKELETON))
    assert step == 2 and item["step"] == 2
    np.testing.assert_array_equal(item["w"], _item(2)["w"])


def test_all_steps_damaged(root):
    for step in (1, 2, 3):
        (root / str(step) / "default" / "orbax_eqx.json").unlink()
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        match=r"(?s)No step of .* could be restored:\n  - step 3: .*\n  - step 2: "
        r".*\n  - step 1: .*The checkpoints are damaged",
    ):
        oeqx.restore_latest(_manager(root), oeqx.EqxRestore(SKELETON))


def test_skeleton_mismatch_is_not_skipped(root):
    bad = {"w": jax.ShapeDtypeStruct((32, 64), jnp.float32), "step": 0}
    with pytest.raises(oeqx.CheckpointMismatchError, match="has shape"):
        oeqx.restore_latest(_manager(root), oeqx.EqxRestore(bad))


def test_empty_manager(tmp_path):
    with pytest.raises(
        oeqx.CheckpointNotFoundError, match="holds no finished step to restore"
    ):
        oeqx.restore_latest(_manager(tmp_path))
