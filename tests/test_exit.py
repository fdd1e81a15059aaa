"""A script that ends without `mngr.wait_until_finished()` still gets its last
step, with one line on stderr naming it and what to call (not a wall of Orbax
tracebacks after a 300 s wait). Each script runs in a fresh interpreter with
a time limit, killed with SIGKILL when it passes."""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
LIMIT_S = 120

_SCRIPT = textwrap.dedent(
    """
    import sys
    import equinox as eqx, jax, orbax.checkpoint as ocp
    import orbax_eqx as oeqx

    model = eqx.nn.MLP(4, 4, 64, 3, key=jax.random.key(0))
    if sys.argv[3] == "typed":  # Orbax's own handler, with the type handler
        registry = oeqx.type_handler_registry()
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
        args = ocp.args.PyTreeSave({"w": model.layers[0].weight})
    elif sys.argv[3] == "late":  # the script ends after our finalize returned
        import threading, time

        ours_done = threading.Event()

        handler = oeqx.EqxHandler()
        ours = handler.finalize

        def late(directory):
            ours(directory)
            if directory.parent.name.startswith("2"):
                ours_done.set()
                time.sleep(2)  # before Orbax renames the step

        handler.finalize = late
        args = oeqx.EqxSave(model)
    else:
        handler = oeqx.EqxHandler()
        args = oeqx.EqxSave(model)
    mngr = ocp.CheckpointManager(sys.argv[1], item_handlers=handler)
    for step in range(3):
        mngr.save(step, args=args)
    if sys.argv[2] == "wait":
        mngr.wait_until_finished()
    if sys.argv[3] == "late":
        ours_done.wait(60)
    print("script done", flush=True)
    """
)


def _run(path, how: str, handler: str = "eqx") -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": PACKAGE_ROOT}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(path), how, handler],
            capture_output=True,
            text=True,
            env=env,
            timeout=LIMIT_S,  # then SIGKILL
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"did not exit in {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, proc.stderr
    assert "script done" in proc.stdout
    return proc


def _one_line_for_step_2(proc, run) -> str:
    """The run's one line of ours on stderr, about step 2, with no traceback
    and every step saved."""
    assert "Traceback" not in proc.stderr
    ours = [line for line in proc.stderr.splitlines() if "orbax_eqx" in line]
    assert len(ours) == 1, proc.stderr
    assert ours[0].startswith("orbax_eqx: the script ended while step `2` (")
    assert sorted(os.listdir(run)) == ["0", "1", "2"]
    return ours[0]


def _restores_step_2(path) -> None:
    skeleton = eqx.nn.MLP(4, 4, 64, 3, key=jax.random.key(1))
    restored = oeqx.restore(path / "2", skeleton)
    expected = eqx.nn.MLP(4, 4, 64, 3, key=jax.random.key(0))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_exit_without_waiting_finishes_the_last_step(tmp_path):
    proc = _run(tmp_path / "run", "exit")
    line = _one_line_for_step_2(proc, tmp_path / "run")
    assert line.endswith(
        "was still being saved; finishing it now. Call "
        "`mngr.wait_until_finished()` (or `mngr.close()`, or use the manager in a "
        "`with` block) before a script ends."
    )
    _restores_step_2(tmp_path / "run")


@pytest.mark.slow
def test_exit_after_our_finalize_still_waits_for_the_commit(tmp_path):
    # Our `finalize` has returned, Orbax has yet to rename step 2: that rename
    # needs the executors Python shuts down at exit, so the step is waited for.
    proc = _run(tmp_path / "run", "exit", "late")
    _one_line_for_step_2(proc, tmp_path / "run")
    _restores_step_2(tmp_path / "run")


@pytest.mark.slow
def test_exit_after_waiting_says_nothing(tmp_path):
    proc = _run(tmp_path / "run", "wait")
    assert "orbax_eqx" not in proc.stderr
    assert "Traceback" not in proc.stderr
    _restores_step_2(tmp_path / "run")


@pytest.mark.slow
def test_exit_without_waiting_finishes_a_type_handler_step(tmp_path):
    proc = _run(tmp_path / "run", "exit", "typed")
    _one_line_for_step_2(proc, tmp_path / "run")
    registry = oeqx.type_handler_registry()
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    with ocp.Checkpointer(handler) as checkpointer:
        restored = checkpointer.restore(tmp_path / "run" / "2" / "default")
    expected = eqx.nn.MLP(4, 4, 64, 3, key=jax.random.key(0)).layers[0].weight
    np.testing.assert_array_equal(restored["w"], expected)
