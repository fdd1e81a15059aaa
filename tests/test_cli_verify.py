"""`python -m orbax_eqx verify`, run as a user runs it, on sound and damaged
checkpoints (the checks themselves: tests/test_damaged_arrays.py)."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from test_cli import run_cli

import orbax_eqx as oeqx


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"model": eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), "n": 3})
    return path


def _flip_first_byte_of(path, name):
    record = oeqx.metadata(path).leaves[name]
    pack = path / oeqx.metadata(path).packs[0].file
    with open(pack, "r+b") as f:
        f.seek(record.offset)
        (byte,) = f.read(1)
        f.seek(record.offset)
        f.write(bytes([byte ^ 1]))


@pytest.mark.slow
def test_verify_a_sound_checkpoint(ckpt):
    result = run_cli("verify", ckpt, cwd=ckpt.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"4 of 4 arrays (200 B) in {ckpt} match their checksums.\n"
    )
    assert result.stderr == ""  # no progress bar in a pipe


@pytest.mark.slow
def test_verify_lists_each_damaged_leaf_and_exits_1(ckpt):
    _flip_first_byte_of(ckpt, "model.layers.1.weight")
    result = run_cli("verify", ckpt, cwd=ckpt.parent)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(
        "DAMAGED `model.layers.1.weight`: data does not match its XXH3-64: 0x"
    )
    assert lines[1] == (
        f"1 of 4 arrays in {ckpt} are damaged. Restore an earlier step, or re-save "
        "the checkpoint."
    )


@pytest.mark.slow
def test_verify_json(ckpt):
    _flip_first_byte_of(ckpt, "model.layers.0.bias")
    result = run_cli("verify", ckpt, "--json", cwd=ckpt.parent)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["nbytes"] == 200
    assert [d["name"] for d in report["damaged"]] == ["model.layers.0.bias"]
    assert sorted(report["checked"]) == [
        "model.layers.0.weight",
        "model.layers.1.bias",
        "model.layers.1.weight",
    ]


@pytest.mark.slow
def test_verify_reports_a_missing_pack_per_leaf(ckpt):
    (ckpt / oeqx.metadata(ckpt).packs[0].file).unlink()
    result = run_cli("verify", ckpt, cwd=ckpt.parent)
    assert result.returncode == 1
    assert result.stdout.count("DAMAGED") == 4
    assert "is missing: the checkpoint is damaged" in result.stdout


@pytest.mark.slow
def test_verify_without_checksums_says_so(tmp_path):
    path = tmp_path / "old"
    oeqx.save(path, {"w": jnp.ones(3)}, checksums=False)
    result = run_cli("verify", path, cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [
        "1 leaves record no checksum (saved with checksums=False): read, not checked.",
        f"0 of 1 arrays (12 B) in {path} match their checksums.",
    ]


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, r"orbax_eqx: error: .*nope does not exist\."),
        (
            lambda p: (p / "ckpt" / "orbax_eqx.json").write_text("{"),
            r"orbax_eqx: error: The sidecar .*orbax_eqx.json is not JSON as "
            r"orbax_eqx writes it",
        ),
    ],
    ids=["missing", "bad_sidecar"],
)
@pytest.mark.slow
def test_verify_errors_are_one_line_and_exit_2(ckpt, setup, message):
    setup(ckpt.parent)
    target = ckpt if "sidecar" in message else ckpt.parent / "nope"
    result = run_cli("verify", target, cwd=ckpt.parent)
    assert result.returncode == 2
    assert re.fullmatch(message + r".*\n", result.stderr), result.stderr
    assert result.stdout == ""


@pytest.fixture
def root(tmp_path):
    """A CheckpointManager root with steps 5, 6 and 7 of one model."""
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler()) as m:
        for step in (5, 6, 7):
            m.save(step, args=oeqx.EqxSave(model))
    return tmp_path / "run"


@pytest.mark.slow
def test_verify_a_manager_root_checks_every_step(root):
    _flip_first_byte_of(root / "6" / "default", "layers.1.weight")
    result = run_cli("verify", "run", cwd=root.parent)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"CheckpointManager root {root}: 3 step(s); checking every step."
    )
    assert (
        lines[1] == f"4 of 4 arrays (200 B) in {root}/5/default match their checksums."
    )
    assert lines[2].startswith("DAMAGED `layers.1.weight`: ")
    assert lines[3] == (
        f"1 of 4 arrays in {root}/6/default are damaged. Restore an earlier step, "
        "or re-save the checkpoint."
    )
    assert (
        lines[4] == f"4 of 4 arrays (200 B) in {root}/7/default match their checksums."
    )
    assert lines[5:] == [
        "Damaged: 1 step of 3 (6). The newest sound step is 7; "
        "`oeqx.restore_latest` falls back past damaged steps."
    ]

    # --latest: the latest step only, which is sound.
    result = run_cli("verify", "run", "--latest", cwd=root.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"CheckpointManager root {root}: 3 step(s); checking the latest only.",
        f"4 of 4 arrays (200 B) in {root}/7/default match their checksums.",
        f"1 step of {root}: every array matches.",
    ]


@pytest.mark.slow
def test_verify_a_manager_root_goes_on_past_an_unreadable_step(root):
    (root / "7" / "default" / "orbax_eqx.json").write_text("{")
    result = run_cli("verify", "run", "--json", cwd=root.parent)
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["path"] == str(root) and doc["steps"] == [5, 6, 7]
    assert [(c["step"], c["ok"]) for c in doc["checkpoints"]] == [
        (5, True),
        (6, True),
        (7, False),
    ]
    assert doc["checkpoints"][0]["nbytes"] == 200 and doc["ok"] is False
    assert re.match(
        r"The sidecar .*/7/default/orbax_eqx\.json is not JSON as orbax_eqx writes it",
        doc["checkpoints"][2]["error"],
    )

    result = run_cli("verify", "run", cwd=root.parent)
    assert result.returncode == 1
    assert re.search(
        rf"^UNREADABLE {root}/7/default: The sidecar .* is not JSON as orbax_eqx "
        r"writes it",
        result.stdout,
        re.M,
    )
    assert result.stdout.endswith(
        "Damaged: 1 step of 3 (7). The newest sound step is 6; "
        "`oeqx.restore_latest` falls back past damaged steps.\n"
    )


@pytest.mark.slow
def test_verify_a_step_with_several_items_checks_each(tmp_path):
    step = tmp_path / "3"
    oeqx.save(step / "model", {"w": jnp.ones(3)})
    oeqx.save(step / "ema", {"w": jnp.zeros(3)})
    result = run_cli("verify", step, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"1 of 1 arrays (12 B) in {step}/ema match their checksums.",
        f"1 of 1 arrays (12 B) in {step}/model match their checksums.",
        f"2 items of {step}: every array matches.",
    ]
