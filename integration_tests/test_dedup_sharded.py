"""Sharded arrays stored once across processes (`EqxHandler(dedup=True)`):
2 JAX processes x 4 CPU devices (`jax.distributed` on 127.0.0.1) save a
frozen sharded base beside a trained head 4 times; each process writes only
the chunks it holds that changed, and both restore every kept step bitwise.
"""

import json

from . import _procs

WORKER = "_dedup_sharded_worker.py"


def test_a_sharded_base_is_written_once_by_every_process(tmp_path):
    root = tmp_path / "run"
    texts = _procs.run(
        WORKER,
        "save",
        root,
        processes=2,
        devices=4,
        log_dir=tmp_path / "logs",
        timeout=180,
    )
    for text in texts:
        assert text.rstrip().endswith("ok"), text
        assert "steps [1, 2, 3]" in text, text
    sizes = json.loads((tmp_path / "shared-sizes.json").read_text())
    shards = [{n: s for n, s in new.items() if "~shards." in n} for new in sizes]
    # The first save: every process's distinct chunks of the base and head.
    assert sorted(n.rsplit(".", 2)[1] for n in shards[0]) == ["0", "1"]
    assert sum(shards[0].values()) == (64 * 1024 + 256 * 64 + 8 * 64) * 4
    # Then only the head's chunks (4 row blocks of 2 x 64 float32), by the
    # processes that hold them.
    for new in shards[1:]:
        assert sum(new.values()) == 8 * 64 * 4, new
