"""Forced copies (`ORBAX_EQX_STAGING=copy`) across two JAX processes.

Each process gathers its small shards on its own devices before copying them
to host, and restores through the staging window onto shardings that span
both processes, streaming boxes larger than the window (see
`_staging_worker.py`). The workers are killed (SIGKILL) past the time limit.
"""

import json

from . import _procs

WORKER = "_staging_worker.py"
TIMEOUT_S = 240


def _run(mode, root, logs):
    texts = _procs.run(
        WORKER, mode, root, processes=2, devices=4, log_dir=logs, timeout=TIMEOUT_S
    )
    for text in texts:
        assert text.rstrip().endswith("ok"), text
    return [json.loads(text.splitlines()[-2]) for text in texts]


def test_two_processes_gather_small_shards_and_restore_through_the_window(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ORBAX_EQX_STAGING", "copy")
    root = tmp_path / "ckpt"
    saved = _run("save", root, tmp_path / "save")
    for stats in saved:
        # 100 small arrays over 8 devices: 400 distinct shards a process, 100
        # on each of its 4 devices, gathered a few batches a device (the
        # primary also copies the packed table).
        assert stats["gathered"] >= 400, stats
        assert stats["transfers"] <= 4 * 8 + 3, stats
    restored = _run("restore", root, tmp_path / "restore")
    for stats in restored:
        assert 0 < stats["peak"] <= 8 << 20 and stats["parts"] >= 4, stats
