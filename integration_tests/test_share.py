"""Many processes: each reads only what its devices hold, and none hangs.

A model of 37 arrays is saved by 2 processes x 4 CPU devices, then restored
by 2 or 4 processes onto several meshes. Each process must read at most
1.3x the distinct bytes its devices hold, plus 2 MiB (`/proc/self/io`
rchar: the sidecar, indexes and Python's own reads included), all of them
together at most 1.5x the model, and its peak RSS may grow by at most 1.5x
what it holds. (Together they read what they hold: an array replicated
over processes is read by each of them.) Targets that put every array on
process 0's devices restore (process 1 holds nothing); a failure that only
one process sees makes every process fail with the same message, in bounded
time.
"""

import json
import re
import shutil

import pytest

from . import _procs

WORKER = "_share_worker.py"
TIMEOUT_S = 300
MIB = 1 << 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("share")
    path = base / "ckpt"
    _procs.run(
        WORKER,
        "save",
        path,
        "-",
        devices=4,
        processes=2,
        log_dir=base / "logs",
        timeout=TIMEOUT_S,
    )
    return path


def _results(logs, tag):
    out = []
    for text in logs:
        lines = [line for line in text.splitlines() if line.startswith(tag + " ")]
        assert lines, text[-3000:]
        out.append(json.loads(lines[-1][len(tag) + 1 :]))
    return out


@pytest.mark.parametrize(
    "processes, target",
    [(4, "8x1"), (4, "4x2"), (4, "2x4"), (2, "2x4"), (2, "8x1")],
    ids=["4x2dev-8x1", "4x2dev-4x2", "4x2dev-2x4", "2x4dev-2x4", "2x4dev-8x1"],
)
def test_each_process_reads_and_holds_its_share(saved, tmp_path, processes, target):
    logs = _procs.run(
        WORKER,
        "restore",
        saved,
        target,
        devices=8 // processes,
        processes=processes,
        log_dir=tmp_path,
        timeout=TIMEOUT_S,
    )
    results = _results(logs, "RESULT")
    model = results[0]["model"]
    for r in results:
        assert r["read"] <= 1.3 * r["held"] + 2 * MIB, r
        assert r["peak"] <= 1.5 * r["held"] + 2 * MIB, r
    if target == "2x4":  # the saving mesh: every box a stored chunk, no copy
        for r in results:
            assert r["pairs"] > 0 and r["views"] == r["pairs"], r
    # Together: what they hold (each replica across processes counts: a
    # process must read what it holds), never the model once per process.
    held = sum(r["held"] for r in results)
    assert sum(r["read"] for r in results) <= 1.5 * held + processes * 2 * MIB
    if held <= model:  # no replica on two processes: at most 1.5x the model
        assert sum(r["read"] for r in results) <= 1.5 * model + processes * 2 * MIB


@pytest.mark.parametrize("mode", ["restore", "staged"])  # staged: as on accelerators
@pytest.mark.parametrize("target", ["one", "first4"])
def test_every_array_on_process_0s_devices_restores(saved, tmp_path, target, mode):
    logs = _procs.run(
        WORKER,
        mode,
        saved,
        target,
        devices=4,
        processes=2,
        log_dir=tmp_path,
        timeout=TIMEOUT_S,
    )
    results = _results(logs, "RESULT")
    assert results[1]["held"] == 0 and results[0]["held"] > 0
    assert results[1]["read"] <= 2 * MIB


def _chunk(path, leaf, start):
    """(shard pack, offset) of `leaf`'s chunk starting at `start`."""
    for index in path.glob("orbax_eqx~shards.*.json"):
        content = json.loads(index.read_text())
        for row in content["chunks"].get(leaf.replace(".", "\\."), []):
            if row[0] == start:
                return path / content["file"], row[2]
    raise KeyError((leaf, start))


@pytest.fixture(scope="module")
def saved_step(tmp_path_factory):
    base = tmp_path_factory.mktemp("share-manager")
    root = base / "root"
    _procs.run(
        WORKER,
        "save",
        root,
        "manager",
        devices=4,
        processes=2,
        log_dir=base / "logs",
        timeout=TIMEOUT_S,
    )
    return root


@pytest.mark.parametrize(
    "fault, through",
    [
        ("damaged-chunk", "restore"),
        ("missing-file", "restore"),
        ("damaged-chunk", "manager"),
    ],
    ids=["damaged-chunk", "missing-file", "damaged-chunk-manager"],
)
def test_a_failure_one_process_sees_stops_every_process(
    saved, saved_step, tmp_path, fault, through
):
    if through == "manager":  # Orbax's barriers around the handler's restore
        root = tmp_path / "root"
        shutil.copytree(saved_step, root)
        path = root / "0" / "default"
    else:
        root = path = tmp_path / "ckpt"
        shutil.copytree(saved, path)
    if fault == "damaged-chunk":
        # Rows 128-256 of w1: on a (2, 4) mesh, only process 1's devices.
        pack, offset = _chunk(path, "blocks.3.w1", [128, 0])
        raw = bytearray(pack.read_bytes())
        raw[offset + 10] ^= 1
        pack.write_bytes(bytes(raw))
        match = "changed after it was saved"
    else:
        # Process 1 sees the checkpoint without one shard pack (a file only
        # it cannot open); process 0 sees it whole.
        other = tmp_path / "ckpt.p1"
        shutil.copytree(saved, other)
        (pack,) = [p for p in other.glob("orbax_eqx~shards.*.0.bin")]
        pack.unlink()
        match = "it is missing"
    logs = _procs.run(
        WORKER,
        "fail-manager" if through == "manager" else "fail",
        root,
        "2x4",
        devices=4,
        processes=2,
        log_dir=tmp_path,
        timeout=TIMEOUT_S,
    )
    errors = _results(logs, "ERROR")
    assert errors[0] == errors[1], errors
    kind, message = errors[0]
    assert kind == "CheckpointDamagedError" and match in message, message
    assert "(Process 1 of 2 found this; every process of the restore stops" in message


def test_a_process_that_never_reports_is_an_error_in_bounded_time(saved, tmp_path):
    logs = _procs.run(
        WORKER,
        "vanish",
        saved,
        "2x4",
        devices=4,
        processes=2,
        log_dir=tmp_path,
        timeout=TIMEOUT_S,
    )
    errors = _results(logs[:1], "ERROR")
    kind, message = errors[0]
    assert kind == "RestoreFailedElsewhereError", message
    assert re.match(
        r"Process 1 of 2 did not finish its part of the restore of .* within 20 s "
        r"\(Orbax's coordination timeout\): it crashed, was killed, or is still "
        r"reading\. Look at that process's log; every process stops the restore\.",
        message,
    ), message
