"""Orbax's own PyTreeCheckpointHandler with `oeqx.type_handler_registry()`, on
8 fake CPU devices and on 2 processes x 4 devices (`jax.distributed` on
loopback): sharded arrays saved as shard packs, each process writing its own,
then restored onto another mesh, onto fewer devices and onto one device.

Each topology is a new set of processes (see `_procs`); the worker is
`_type_handler_worker.py`.
"""

import json

from . import _procs

WORKER = "_type_handler_worker.py"
TIMEOUT_S = 150


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
        # The worker prints `ok` after its last check and exits 0 (`_procs`
        # checks the exit code). Not necessarily the last line: on Python 3.13
        # a thread of Orbax's that outlives its event loop, after the restore
        # the worker expects to fail, was seen once (in about 35 runs) to print
        # "RuntimeError: Event loop is closed" at interpreter exit.
        assert "ok" in text.splitlines(), text
        assert f"of {processes}: {devices} local devices" in text, text
    return texts


def test_sharded_save_restores_onto_another_mesh_and_one_device(tmp_path):
    root = tmp_path / "ckpt"
    (saved,) = _run("save", root, processes=1, devices=8, logs=tmp_path / "save")
    # Restored in the saving process onto a (2, 4) mesh across the chunks.
    assert "equal: 29 arrays, on NamedSharding(mesh=Mesh('a': 2, 'b': 4" in saved
    (loaded,) = _run("restore", root, processes=1, devices=1, logs=tmp_path / "load")
    assert "equal: 29 arrays, on SingleDeviceSharding(" in loaded


def test_two_processes_save_their_own_shards_and_one_restores(tmp_path):
    root = tmp_path / "ckpt"
    texts = _run("save", root, processes=2, devices=4, logs=tmp_path / "save")
    for text in texts:  # each process saw both processes' shard packs
        assert ".0.json'" in text and ".1.json'" in text, text
    (loaded,) = _run("restore", root, processes=1, devices=4, logs=tmp_path / "load")
    assert "equal: 29 arrays, on NamedSharding(mesh=Mesh('x': 4" in loaded
    assert "equal: 29 arrays, on SingleDeviceSharding(" in loaded


def test_a_failure_one_process_sees_stops_every_process(tmp_path):
    # Process 1's own shard pack is damaged: on the saving mesh only its
    # devices read it. Both processes raise the same error; neither is left
    # waiting in Orbax's barriers.
    root = tmp_path / "ckpt"
    _run("save", root, processes=2, devices=4, logs=tmp_path / "save")
    (pack,) = (root / "1" / "default").glob("orbax_eqx~typed.*/*shards.*.1.bin")
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 1
    pack.write_bytes(bytes(raw))
    texts = _run("fail", root, processes=2, devices=4, logs=tmp_path / "fail")
    errors = [
        json.loads(line[len("ERROR ") :])
        for text in texts
        for line in text.splitlines()
        if line.startswith("ERROR ")
    ]
    assert len(errors) == 2 and errors[0] == errors[1], errors
    kind, message = errors[0]
    assert kind == "CheckpointDamagedError", message
    assert "changed after it was saved" in message, message
    assert "(Process 1 of 2 found this; every process of the restore stops" in message
