"""A deep model saved by several JAX processes: no hang, restores anywhere.

A 24-block LM (every 2-D weight sharded over all 8 devices of all processes)
used to hang both processes of a 2-process save forever from 16 blocks on:
the save ran a collective per sharded array, which interleaved with Orbax's
own. Saves run no computation now; each process writes its own shard pack.
The workers are killed (SIGKILL) if they pass the time limit, so a hang fails
the test instead of stalling the run.
"""

import pytest

from . import _procs

WORKER = "_deep_worker.py"
BLOCKS = "24"
TIMEOUT_S = 240


def _run(mode, root, *, processes, devices, logs):
    texts = _procs.run(
        WORKER,
        mode,
        root,
        BLOCKS,
        processes=processes,
        devices=devices,
        log_dir=logs,
        timeout=TIMEOUT_S,
    )
    for text in texts:
        assert text.rstrip().endswith("ok"), text
    return texts


@pytest.mark.parametrize(
    "save_with, restore_with",
    [((2, 4), [(4, 2), (1, 1)]), ((4, 2), [(1, 1)])],
    ids=["2x4-to-4x2-and-1x1", "4x2-to-1x1"],
)
def test_deep_model_saved_by_many_processes_restores_anywhere(
    tmp_path, save_with, restore_with
):
    """(processes, devices each) of the save, then of each restore."""
    root = tmp_path / "ckpt"
    processes, devices = save_with
    saved = _run(
        "save", root, processes=processes, devices=devices, logs=tmp_path / "s"
    )
    assert "saved 146 sharded arrays" in saved[0], saved[0]
    step = root / "1" / "default"
    files = sorted(p.name for p in step.iterdir() if p.name.startswith("orbax_eqx~s"))
    assert len(files) == 2 * processes, files  # a shard pack and index each
    for processes, devices in restore_with:
        logs = tmp_path / f"r{processes}x{devices}"
        _run("restore", root, processes=processes, devices=devices, logs=logs)
