"""Sharded saves and restores onto other meshes, with 8 fake CPU devices.

JAX fixes its device count when it starts, so each case runs
`_sharded_worker.py` in its own process: 8 devices to save on a (4, 2) mesh,
1 device or 8 devices on a (2, 4) mesh to restore.
"""

import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_sharded_worker.py")
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"
TIMEOUT_S = 180


def _run(mode: str, root, *extra: str, devices: int) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")
    }
    env["JAX_PLATFORMS"] = "cpu"
    if devices == 8:
        env["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " " + EIGHT_DEVICES
        ).strip()
    else:
        # Keep any unrelated XLA flags, minus a device count from outside.
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        if flags:
            env["XLA_FLAGS"] = " ".join(flags)
    result = subprocess.run(
        [sys.executable, WORKER, mode, str(root), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, f"{mode} {' '.join(extra)} failed:\n{output}"
    assert result.stdout.rstrip().endswith("ok"), output
    return result.stdout


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory):
    """A CheckpointManager root holding a model saved sharded on a (4, 2) mesh."""
    root = tmp_path_factory.mktemp("sharded") / "ckpt"
    _run("save", root, devices=8)
    assert (root.parent / "expected.npz").exists()
    return root


def test_restore_on_one_device(sharded_root):
    out = _run("restore-one", sharded_root, devices=1)
    assert "model.layers.0.weight: float32[32, 16] equal" in out


@pytest.mark.parametrize(
    "how",
    ["default", "replicated", "tree", "function", "skeleton"],
    ids=[
        "no-shardings",
        "one-sharding",
        "tree-of-shardings",
        "sharding-function",
        "skeleton-shardings",
    ],
)
def test_restore_onto_other_mesh(sharded_root, how):
    out = _run("restore-mesh", sharded_root, how, devices=8)
    assert "model.layers.1.weight: float32[8, 32] equal" in out


def test_arrays_donated_right_after_save_restore_as_saved(tmp_path):
    """On 8 devices, a training step may donate every sharded array as soon as
    `save` returns: on CPU the save holds numpy's views of the shards (JAX
    then copies instead of reusing them). The copies an accelerator makes
    instead are donated at once in `tests/test_staging.py`."""
    out = _run("save-donate", tmp_path / "ckpt", devices=8)
    assert "step 2: 27 arrays" in out, out
