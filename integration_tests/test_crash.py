"""kill -9 and SIGTERM in the middle of async saves never cost a good step.

Each trial starts a process that saves step after step, kills it at a random
moment (seeded, so a failure can be replayed), then opens a fresh manager on
the directory and checks that the latest step is complete and restores to
exactly the values saved at that step, that no temporary directory is taken
for a step, and that stale temporary directories do not pile up.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import orbax_eqx as oeqx

from ._crash_worker import crash_item, manager

WORKER = Path(__file__).with_name("_crash_worker.py")
ROUNDS = int(os.environ.get("ORBAX_EQX_KILL_ROUNDS", "50"))
SEED = 20261121


def _skeleton():
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
        ),
        crash_item(0),
    )


def _assert_holds(restored, step):
    expected = crash_item(step)
    assert restored["step"] == step and restored["tag"] == f"step-{step}"
    for name, array in expected["arrays"].items():
        np.testing.assert_array_equal(restored["arrays"][name], array, err_msg=name)


def _start(root, first):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(root), str(first)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )


def _tmp_dirs(root):
    return [p for p in Path(root).iterdir() if ".orbax-checkpoint-tmp" in p.name]


def _wait_until_cleaned(root, timeout=30.0):
    # The manager removes stale temporary directories in the background.
    deadline = time.monotonic() + timeout
    while _tmp_dirs(root):
        assert time.monotonic() < deadline, f"not cleaned: {_tmp_dirs(root)}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill9", "term"])
def test_killed_saves_never_corrupt_the_latest_step(tmp_path, sig):
    rng = random.Random(SEED + sig)
    rounds = ROUNDS if sig == signal.SIGKILL else max(ROUNDS // 5, 3)
    root = tmp_path / "ckpt"
    latest, restores, max_tmp = None, 0, 0
    for _ in range(rounds):
        first = 0 if latest is None else latest + 1
        proc = _start(root, first)
        try:
            assert proc.stdout.readline().startswith("saving"), "worker did not start"
            time.sleep(rng.uniform(0.0, 2.5))
            proc.send_signal(sig)
            proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.stdout.close()
        # The crash may leave one temporary directory; the restarted manager
        # (cleanup_tmp_directories=True) removes it, so they never pile up.
        max_tmp = max(max_tmp, len(_tmp_dirs(root)))
        mngr = manager(root)
        _wait_until_cleaned(root)
        steps = mngr.all_steps()
        assert all(
            p.name.isdigit()
            for p in root.iterdir()
            if p.name[0].isdigit() and ".orbax-checkpoint-tmp" not in p.name
        )
        latest = mngr.latest_step()
        if latest is not None:
            assert latest == max(steps)
            restored = mngr.restore(latest, args=oeqx.EqxRestore(_skeleton()))
            _assert_holds(restored, latest)
            restores += 1
        mngr.close()
    assert max_tmp <= 1, f"{max_tmp} stale temporary directories"
    assert restores >= rounds // 2, f"only {restores} rounds had a finished step"
    # The next save after all that goes through.
    mngr = manager(root)
    step = (latest or 0) + 1
    mngr.save(step, args=oeqx.EqxSave(crash_item(step)))
    mngr.wait_until_finished()
    _assert_holds(mngr.restore(step, args=oeqx.EqxRestore(_skeleton())), step)
    mngr.close()
    print(
        f"{rounds} kill points ({sig.name}), {restores} restores checked, 0 corrupted"
    )
