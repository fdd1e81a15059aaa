"""Standalone saves in a multi-host run: every process calls `oeqx.save`, the
new checkpoint is written beside the old by all of them and swapped in by the
primary host (process 0 unless `MultiprocessingOptions(primary_host=...)` says
otherwise, as for the handler), and every process returns (or fails) with the
same outcome."""

import pytest

from . import _procs


@pytest.mark.parametrize("mode", ["overwrite", "primary1"])
def test_overwrite_of_global_arrays_by_two_processes(tmp_path, mode):
    texts = _procs.run(
        "_replace_multihost_worker.py",
        mode,
        tmp_path / "base",
        processes=2,
        devices=2,
        log_dir=tmp_path / "logs",
        timeout=180,
    )
    for text in texts:
        assert text.rstrip().endswith("ok"), text
