"""The scripts in `examples/` run as a user runs them, each in a fresh
interpreter with a time limit (killed with SIGKILL when it passes)."""

import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_resume.py")
LIMIT_S = 300


def _run(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    try:
        return subprocess.run(
            [sys.executable, TRAIN, *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,  # then SIGKILL
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ran past {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")


@pytest.mark.slow
def test_train_resume_after_a_crash_ends_as_an_uninterrupted_run(tmp_path):
    steps = ["--steps", "60", "--save-every", "10"]
    whole = _run("whole", *steps, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.startswith("Starting from scratch.\n")

    crashed = _run("crashed", *steps, "--crash-at", "35", cwd=tmp_path)
    assert crashed.returncode == 1, crashed.stderr
    assert crashed.stdout.endswith("Crashing after step 35.\n")
    resumed = _run("crashed", *steps, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    found = re.match(r"Resuming after step (\d+)\.\n", resumed.stdout)
    assert found and int(found.group(1)) in (20, 30), resumed.stdout  # 30: if saved
    assert resumed.stdout.splitlines()[-1] == whole.stdout.splitlines()[-1]

    # The resumed run computed exactly what the uninterrupted one did.
    sys.path.insert(0, os.path.dirname(TRAIN))
    try:
        import train_resume
    finally:
        sys.path.remove(os.path.dirname(TRAIN))
    skeleton = eqx.filter_eval_shape(train_resume.init_state, jax.random.key(0))
    a = oeqx.restore(tmp_path / "whole" / "60", skeleton)
    b = oeqx.restore(tmp_path / "crashed" / "60", skeleton)
    assert a["step"] == b["step"] == 60
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert sorted(os.listdir(tmp_path / "crashed"))[-3:] == ["40", "50", "60"]


def test_a_step_killed_while_saving_saves_again_when_resumed(tmp_path):
    """The leftover of a save killed part way (what `--crash-at` leaves when a
    save is in flight) is no other save: the step saves again over it."""
    leftover = tmp_path / "run" / "30.orbax-checkpoint-tmp"
    (leftover / "default.orbax-checkpoint-tmp").mkdir(parents=True)
    (leftover / "default.orbax-checkpoint-tmp" / "orbax_eqx~packed.x.0.bin").touch()
    item = {"w": np.arange(4.0)}
    for attempt in range(3):  # Orbax removes the leftover in the background
        with ocp.CheckpointManager(
            tmp_path / "run", item_handlers=oeqx.EqxHandler()
        ) as mngr:
            mngr.save(30 + attempt, args=oeqx.EqxSave(item))
        np.testing.assert_array_equal(
            oeqx.restore(tmp_path / "run" / str(30 + attempt))["w"], item["w"]
        )
        leftover = tmp_path / "run" / f"{31 + attempt}.orbax-checkpoint-tmp"
        (leftover / "default.orbax-checkpoint-tmp").mkdir(parents=True)
