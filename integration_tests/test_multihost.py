"""Several JAX processes on this machine (`jax.distributed` on 127.0.0.1, fake
CPU devices in each): save a globally sharded model through CheckpointManager
with EqxHandler, restore it with a different number of processes and devices.

Also: the sidecar is written exactly once, by the primary process, and every
process computes the same content; a host-local array is refused, naming the
leaf, before anything is written.
"""

import json
import re

import pytest

from tests.sidecars import expand

from . import _procs

WORKER = "_multihost_worker.py"
TIMEOUT_S = 120


def _run(mode, root, *, processes, devices, logs):
    texts = _procs.run(
        WORKER,
        mode,
        root,
        processes=processes,
        devices=devices,
        log_dir=logs,
        timeout=TIMEOUT_S,
    )
    for text in texts:
        assert text.rstrip().endswith("ok"), text
        assert f"of {processes}: {devices} local devices" in text, text
    return texts


def _check_sidecars(root, processes, steps=(1, 2)):
    hosts = root.parent / "hosts"
    writes = {
        p: (hosts / f"writes-p{p}.txt").read_text().split()
        if (hosts / f"writes-p{p}.txt").exists()
        else []
        for p in range(processes)
    }
    # Exactly once per step, by the primary process.
    assert writes == {
        0: [str(s) for s in steps],
        **{p: [] for p in range(1, processes)},
    }
    for step in steps:
        computed = [
            json.loads((hosts / f"computed-{step}-p{p}.json").read_text())
            for p in range(processes)
        ]
        assert all(c == computed[0] for c in computed[1:]), f"step {step}"
        on_disk = json.loads(
            (root / str(step) / "default" / "orbax_eqx.json").read_text()
        )
        # The sidecar's own checksum (format 6), last.
        assert on_disk.pop("checksum").startswith("xxh3:")
        on_disk = expand(on_disk)  # every record whole, as computed
        # Every array with data has its checksum, added by the primary alone.
        # (Format 6: a packed leaf's is XXH3-64 in 16 hexadecimal digits.)
        for record in on_disk["leaves"].values():
            data = record.get("data")
            if data == "packed":
                assert re.fullmatch(r"[0-9a-f]{16}", record.pop("xxh3")), record
            elif data == "orbax":
                assert isinstance(record.pop("sum32"), int), record
        assert on_disk == expand(computed[0])  # (rows made before checksums)
        assert on_disk["leaves"]["model.embed.weight"]["shape"] == [24, 16]


@pytest.mark.parametrize(
    "save_with, restore_with",
    [((4, 2), (2, 2)), ((2, 4), (1, 4))],
    ids=["4x2-to-2x2", "2x4-to-1x4"],
)
def test_save_on_many_hosts_restore_on_fewer(tmp_path, save_with, restore_with):
    """(processes, devices each): 4 x 2 -> 2 x 2, and 2 x 4 -> one process."""
    root = tmp_path / "ckpt"
    processes, devices = save_with
    _run("save", root, processes=processes, devices=devices, logs=tmp_path / "save")
    _check_sidecars(root, processes)
    processes, devices = restore_with
    _run("restore", root, processes=processes, devices=devices, logs=tmp_path / "load")


def test_host_local_array_is_refused_before_anything_is_written(tmp_path):
    _run("host-local", tmp_path / "ckpt", processes=2, devices=1, logs=tmp_path)
