"""`inspect`'s tree folds runs of alike list items (the layers of a deep
model) into the first item and one row, unless `--all`."""

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from entry import main

import orbax_eqx as oeqx


class Block(eqx.Module):
    lin: eqx.nn.Linear
    scale: jax.Array


def _block(width: int, seed: int) -> Block:
    return Block(eqx.nn.Linear(width, width, key=jax.random.key(seed)), np.ones(()))


def _inspect(capsys, path, *extra) -> list[str]:
    assert main(["inspect", str(path), *extra]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_run_of_alike_layers_shows_the_first_and_one_row(tmp_path, capsys):
    oeqx.save(tmp_path / "ck", [_block(4, k) for k in range(6)])
    lines = _inspect(capsys, tmp_path / "ck")
    folded = [line for line in lines if " .. " in line]
    assert len(folded) == 1
    assert folded[0].split()[:3] == ["1", "..", "5"]
    assert "Block" in folded[0]
    # 5 blocks of a (4, 4) and a (4,) float32 and a float64 scalar: 5 x 88 B.
    assert "440 B" in folded[0]
    assert folded[0].rstrip().endswith("5 more, each like 0 (--all shows them)")
    # The first block is whole: its class, its Linear and its arrays.
    assert sum("Linear" in line for line in lines) == 1
    assert any(line.split()[:3] == ["weight", "float32", "(4,"] for line in lines)
    # The totals still count every leaf.
    assert "Total: 18 leaves, 18 arrays" in "\n".join(lines)


def test_all_shows_every_item(tmp_path, capsys):
    oeqx.save(tmp_path / "ck", [_block(4, k) for k in range(6)])
    lines = _inspect(capsys, tmp_path / "ck", "--all")
    assert not any(" .. " in line for line in lines)
    assert sum("Linear" in line for line in lines) == 6


@pytest.mark.parametrize(
    ("widths", "runs"),
    [
        ((4, 4), []),  # two alike: not a run
        ((4, 4, 4), [("1", "2")]),
        ((4, 4, 8, 4, 4, 4), [("4", "5")]),  # an odd one out breaks the run
        ((4, 8, 8, 8, 8, 4), [("2", "4")]),
    ],
    ids=["two", "three", "broken", "middle"],
)
def test_only_runs_of_three_or_more_alike_items_fold(tmp_path, capsys, widths, runs):
    oeqx.save(tmp_path / "ck", [_block(w, k) for k, w in enumerate(widths)])
    lines = _inspect(capsys, tmp_path / "ck")
    found = [(line.split()[0], line.split()[2]) for line in lines if " .. " in line]
    assert found == runs


def test_items_that_differ_deeper_down_do_not_fold(tmp_path, capsys):
    # Same class and shapes, but one block's array is float16, another's a
    # numpy array: a person must see which.
    blocks = [_block(4, k) for k in range(4)]
    blocks[2] = eqx.tree_at(
        lambda b: b.lin.bias, blocks[2], blocks[2].lin.bias.astype("float16")
    )
    oeqx.save(tmp_path / "ck", blocks)
    lines = _inspect(capsys, tmp_path / "ck")
    assert not any(" .. " in line for line in lines)
    assert sum("Linear" in line for line in lines) == 4


def test_dict_entries_never_fold(tmp_path, capsys):
    oeqx.save(tmp_path / "ck", {k: _block(4, 0) for k in "abcd"})
    lines = _inspect(capsys, tmp_path / "ck")
    assert not any(" .. " in line for line in lines)
    assert sum("Linear" in line for line in lines) == 4


def test_flat_and_json_list_every_leaf(tmp_path, capsys):
    oeqx.save(tmp_path / "ck", [_block(4, k) for k in range(6)])
    flat = _inspect(capsys, tmp_path / "ck", "--flat")
    assert not any(" .. " in line for line in flat)
    assert sum(line.lstrip().startswith("5.lin.weight") for line in flat) == 1
    as_json = json.loads("\n".join(_inspect(capsys, tmp_path / "ck", "--json")))
    assert len(as_json["items"][0]["leaves"]) == 18
