"""Staged restores (`max_staged_bytes`: CPU devices copy) across two JAX processes.

Each process restores through the staging window onto shardings that span
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
    return texts


def test_two_processes_restore_through_the_window(tmp_path):
    root = tmp_path / "ckpt"
    _run("save", root, tmp_path / "save")
    restored = _run("restore", root, tmp_path / "restore")
    for text in restored:
        stats = json.loads(text.splitlines()[-2])
        # 16 MiB boxes in an 8 MiB window: streamed in parts.
        assert stats["copied"] and stats["peak"] <= (8 << 20) + (2 << 20), stats
