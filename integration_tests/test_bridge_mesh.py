"""safetensors onto a mesh: 8 CPU devices in one process, or 2 processes of 4,
each reading only the byte ranges its own devices' boxes need.

The files are a GPT-2-like set of per-layer tensors (see `_bridge_worker.py`);
the skeleton is scanned (stacked leaves), filled through a hand-made plan
(stack, transpose, qkv split). Every shard is checked bitwise. Targets that
cut the stacked leaves across layers, or within layers along the tensors'
rows, read at most 1.3x what each process's devices hold (`read`: the bytes
asked for; `rchar`: every byte read by the process meanwhile, plus 1 MiB);
column strips read the rows that hold them, never more than the model.
"""

import json

import pytest

from . import _procs

WORKER = "_bridge_worker.py"
TIMEOUT_S = 300
MIB = 1 << 20


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("bridge")
    _procs.run(WORKER, "write", base / "hf", "-", devices=1, log_dir=base / "logs")
    return base / "hf"


def _results(logs):
    out = []
    for text in logs:
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        assert lines, text[-3000:]
        out.append(json.loads(lines[-1][len("RESULT ") :]))
    return out


@pytest.mark.parametrize(
    "processes, target",
    [
        (1, "one"),
        (1, "layers"),
        (1, "within"),
        (1, "columns"),
        (1, "2d"),
        (2, "layers"),
        (2, "within"),
        (2, "columns"),
        (2, "2d"),
    ],
    ids=lambda x: str(x),
)
def test_each_process_reads_its_share(files, tmp_path, processes, target):
    logs = _procs.run(
        WORKER,
        "load",
        files,
        target,
        devices=8 // processes,
        processes=processes,
        log_dir=tmp_path,
        timeout=TIMEOUT_S,
    )
    results = _results(logs)
    for r in results:
        print(target, r)
        assert r["read"] <= r["model"], r
        assert r["rchar"] <= r["read"] + MIB, r  # headers and the index
        if target in ("one", "layers", "within"):
            assert r["read"] <= 1.3 * r["held"], r
            assert r["peak"] <= 1.3 * r["held"] + 8 * MIB, r
    if processes == 2 and target in ("layers", "within"):
        assert sum(r["held"] for r in results) == results[0]["model"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt2")
    _procs.run(WORKER, "write-gpt2", base / "hf", "-", devices=1, log_dir=base / "l")
    return base / "hf"


@pytest.mark.parametrize(
    "processes, target",
    [(1, "layers"), (1, "within"), (2, "layers"), (2, "within")],
    ids=lambda x: str(x),
)
def test_gpt2_through_its_mapping_onto_a_mesh(gpt2_files, tmp_path, processes, target):
    """`load_safetensors` with GPT-2's mapping (fused Conv1D qkv, transposes,
    field keys, masks ignored, tied head): every shard equals the in-memory
    `from_state_dict`; on one process the forward pass equals the numpy
    reference. Cut across layers, each process reads its share; cut within
    layers along the Conv1D weights' columns, the rows that hold them."""
    logs = _procs.run(
        WORKER,
        "load-gpt2",
        gpt2_files,
        target,
        devices=8 // processes,
        processes=processes,
        log_dir=tmp_path,
        timeout=TIMEOUT_S,
    )
    for r in _results(logs):
        print(target, r)
        assert r["read"] <= r["model"], r
        assert r["rchar"] <= r["read"] + MIB, r
        if target == "layers":
            assert r["read"] <= 1.3 * r["held"], r
    if processes > 1:  # and an export of the sharded tree is refused
        assert all("export refused" in text for text in logs)
