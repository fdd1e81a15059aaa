"""`python -m orbax_eqx verify`, run as a user runs it, on sound and damaged
checkpoints (the checks themselves: tests/test_integrity.py)."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
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


def test_verify_a_sound_checkpoint(ckpt):
    result = run_cli("verify", ckpt, cwd=ckpt.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"4 of 4 arrays (200 B) in {ckpt} match their checksums.\n"
    )
    assert result.stderr == ""  # no progress bar in a pipe


def test_verify_lists_each_damaged_leaf_and_exits_1(ckpt):
    _flip_first_byte_of(ckpt, "model.layers.1.weight")
    result = run_cli("verify", ckpt, cwd=ckpt.parent)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(
        "DAMAGED ['model'].layers[1].weight (model.layers.1.weight): data does "
        "not match its CRC-32: 0x"
    )
    assert lines[1] == (
        f"1 of 4 arrays in {ckpt} are damaged. Restore an earlier step, or re-save "
        "this one."
    )


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


def test_verify_reports_a_missing_pack_per_leaf(ckpt):
    (ckpt / oeqx.metadata(ckpt).packs[0].file).unlink()
    result = run_cli("verify", ckpt, cwd=ckpt.parent)
    assert result.returncode == 1
    assert result.stdout.count("DAMAGED") == 4
    assert "is missing: the checkpoint is damaged" in result.stdout


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
            r"orbax_eqx: error: The sidecar .*orbax_eqx.json is not valid JSON",
        ),
    ],
    ids=["missing", "bad_sidecar"],
)
def test_verify_errors_are_one_line_and_exit_2(ckpt, setup, message):
    setup(ckpt.parent)
    target = ckpt if "sidecar" in message else ckpt.parent / "nope"
    result = run_cli("verify", target, cwd=ckpt.parent)
    assert result.returncode == 2
    assert re.fullmatch(message + r".*\n", result.stderr), result.stderr
    assert result.stdout == ""
