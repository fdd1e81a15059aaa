"""A checkpoint replaced (`save(..., overwrite=True)` elsewhere) or being
deleted while it is restored: said so, never "damaged".

Staged at a fixed point, as in `test_deleted_steps.py`: the `shardings=`
function, which a restore calls after reading the sidecar and before reading
any array. Replaced once, the restore reads the new checkpoint; replaced
again meanwhile, it says so.
"""

import os
import shutil
import threading
import warnings

import jax
import numpy as np
import pytest

import orbax_eqx as oeqx

DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _item(seed):
    return {"w": jax.numpy.arange(6.0) + seed, "b": jax.numpy.ones(3) * seed}


def _skeleton():
    return {
        "w": jax.ShapeDtypeStruct((6,), np.float32),
        "b": jax.ShapeDtypeStruct((3,), np.float32),
    }


def _meanwhile(action, times):
    """A `shardings=` function running `action()` at the start of each of the
    first `times` restores that call it."""
    seen = {"first": None, "restores": 0}

    def shardings(name, leaf):
        if seen["first"] is None:
            seen["first"] = name
        if name == seen["first"]:
            seen["restores"] += 1
            if seen["restores"] <= times:
                action(seen["restores"])
        return DEVICE

    return shardings


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_a_checkpoint_replaced_once_restores_the_new_one(tmp_path, pack):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(1), pack=pack)

    def replace(n):
        oeqx.save(path, _item(10 + n), overwrite=True, pack=pack)

    shardings = _meanwhile(replace, times=1)
    restored = oeqx.restore(path, _skeleton(), shardings=shardings)
    assert np.array_equal(restored["w"], _item(11)["w"])


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_a_checkpoint_replaced_again_and_again_is_said_so(tmp_path, pack):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(1), pack=pack)

    def replace(n):
        oeqx.save(path, _item(10 + n), overwrite=True, pack=pack)

    with pytest.raises(
        RuntimeError,
        match=rf"^The checkpoint at {path} was replaced by another save while it "
        r"was being restored \(`save\(..., overwrite=True\)`, or a save of the "
        r"same step, perhaps in another process\); nothing is damaged\. Restore "
        r"it again to read the new one, or save to separate paths\.$",
    ):
        oeqx.restore(path, _skeleton(), shardings=_meanwhile(replace, times=2))
    # And then it restores.
    restored = oeqx.restore(path, _skeleton())
    assert np.array_equal(restored["w"], _item(12)["w"])


def test_a_deletion_under_way_is_said_so_not_damage(tmp_path):
    # The data files go first, the directory a moment later (as a slow
    # `rmtree` of a step that `max_to_keep` dropped).
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(1))

    def delete(n):
        for pack in path.glob("orbax_eqx~packed.*"):
            os.remove(pack)
        threading.Timer(0.1, shutil.rmtree, [path]).start()

    with pytest.raises(oeqx.CheckpointNotFoundError, match=r"was deleted while"):
        oeqx.restore(path, _skeleton(), shardings=_meanwhile(delete, times=1))


def test_damage_found_at_once_is_still_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(1))
    (pack,) = path.glob("orbax_eqx~packed.*")
    data = bytearray(pack.read_bytes())
    data[0] ^= 1
    pack.write_bytes(bytes(data))
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"changed after it was"):
        oeqx.restore(path, _skeleton())
    # A file deleted for good (no deletion of the checkpoint follows) is
    # damage too, after a moment's look.
    os.remove(pack)

    def nothing(n):
        pass

    with pytest.raises(oeqx.CheckpointDamagedError):
        oeqx.restore(path, _skeleton(), shardings=_meanwhile(nothing, times=1))


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_restores_beside_a_job_that_keeps_overwriting(tmp_path, pack):
    # No staging: a thread overwrites the checkpoint as fast as it can while
    # this one restores it. Every restore gives one whole saved item or says
    # the checkpoint was replaced; none calls it damaged.
    path = tmp_path / "ckpt"
    items = {n: _item(n) for n in range(1, 6)}
    oeqx.save(path, items[1], pack=pack)
    stop = threading.Event()
    failures = []

    def overwrite():
        n = 1
        try:
            while not stop.is_set():
                n = n % 5 + 1
                oeqx.save(path, items[n], overwrite=True, pack=pack)
        except Exception as e:  # the test's own failure, not the restore's
            failures.append(e)

    writer = threading.Thread(target=overwrite)
    writer.start()
    said, restored = 0, 0
    try:
        for _ in range(40):
            try:
                got = oeqx.restore(path, _skeleton())
            except RuntimeError:
                said += 1
                continue
            seed = int(got["b"][0])
            assert np.array_equal(got["w"], items[seed]["w"]), seed
            restored += 1
    finally:
        stop.set()
        writer.join()
    assert not failures, failures
    assert restored + said == 40 and restored > 0


def test_restore_latest_reads_a_step_replaced_under_it_again(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler()) as m:
        m.save(1, args=oeqx.EqxSave(_item(1)))
        m.wait_until_finished()
        item_dir = tmp_path / "run" / "1" / "default"

        def replace(n):
            oeqx.save(item_dir, _item(20 + n), overwrite=True)

        shardings = _meanwhile(replace, times=2)  # more than the handler retries
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no FallbackWarning: nothing damaged
            step, got = oeqx.restore_latest(
                m, oeqx.EqxRestore(_skeleton(), shardings=shardings)
            )
    assert step == 1 and np.array_equal(got["w"], _item(22)["w"])


def _step_item(step):
    """Several leaves, each holding `step` (and its place), so that a restore
    mixing two steps' files is told."""
    return {
        f"layer{i}": {
            "w": jax.numpy.full((4, 3), step + i / 10),
            "b": np.full(3, step, np.int32),
        }
        for i in range(4)
    }


@pytest.mark.slow
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_restore_latest_beside_a_manager_deleting_old_steps(tmp_path, pack):
    # No staging: a thread saves step after step through a manager with
    # `max_to_keep=2`, deleting old steps, while another manager (as a reader
    # in another process would) calls `restore_latest` for a few seconds.
    # Every call gives one whole saved step, or says the steps were deleted
    # (`CheckpointNotFoundError`); none raises a raw OSError. A step whose
    # deletion is under way as it is read may still be passed over for an
    # older one with a warning, which must then name a file gone missing.
    import time
    import warnings

    import orbax.checkpoint as ocp

    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    handler = oeqx.EqxHandler(pack=pack)
    skeleton = jax.eval_shape(lambda: _step_item(0))
    stop = threading.Event()
    failures = []
    with ocp.CheckpointManager(root, item_handlers=handler, options=options) as m:
        m.save(0, args=oeqx.EqxSave(_step_item(0)))
        m.wait_until_finished()

        def save_steps():
            step = 0
            try:
                while not stop.is_set():
                    step += 1
                    m.save(step, args=oeqx.EqxSave(_step_item(step)))
                    m.wait_until_finished()
            except Exception as e:  # the test's own failure, not the restore's
                failures.append(e)

        writer = threading.Thread(target=save_steps)
        writer.start()
        restored, said = set(), 0
        try:
            reader = ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always", oeqx.OrbaxEqxWarning)
                        step, got = oeqx.restore_latest(
                            reader, oeqx.EqxRestore(skeleton)
                        )
                except oeqx.CheckpointNotFoundError:
                    said += 1
                    continue
                for w in caught:
                    reasons = str(w.message).splitlines()[1:]
                    assert reasons and all("is missing" in r for r in reasons), w
                want = _step_item(step)
                for name in want:
                    for leaf in ("w", "b"):
                        assert np.array_equal(got[name][leaf], want[name][leaf]), step
                restored.add(step)
        finally:
            stop.set()
            writer.join()
    assert not failures, failures
    assert len(restored) > 1, (restored, said)
