"""Steps with several items, of several kinds: `inspect` lists the items that
are none of ours, `diff` compares two steps (or manager roots) item by item or
one item by name (`--item`, for `export` too), typed PRNG keys are compared
as keys, and `diff --values` stays aligned with long names."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from entry import main

import orbax_eqx as oeqx

LONG = "opt_state_of_a_rather_deeply_nested_optimizer_leaf_with_a_long_name"


def _items(scale: float, seed: int):
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    model = jax.tree.map(lambda x: x * scale, model)
    return {"model": model, "key": jax.random.key(seed), LONG: jnp.ones(3)}


def _root(path, scale: float, seed: int, json_item: str):
    """A manager root, steps 1 and 2: `model` (orbax_eqx), `opt` (plain Orbax,
    StandardSave) and a JSON item named `json_item`."""
    tree = _items(scale, seed)
    opt = optax.adam(1e-3).init(eqx.filter(tree["model"], eqx.is_array))
    with ocp.CheckpointManager(path, item_names=("model", "opt", json_item)) as mngr:
        for step in (1, 2):
            args = {
                "model": oeqx.EqxSave(tree),
                "opt": ocp.args.StandardSave(opt),
                json_item: ocp.args.JsonSave({"lr": 1e-3}),
            }
            mngr.save(step, args=ocp.args.Composite(**args))
        mngr.wait_until_finished()
    return path


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("roots")
    a = _root(base / "a", 1.0, 1, "meta")
    b = _root(base / "b", 1.5, 2, "data")
    oeqx.save(base / "single", _items(1.0, 1))
    return a, b, base / "single"


def test_inspect_lists_the_other_items(roots, capsys):
    a, _, _ = roots
    assert main(["inspect", str(a)]) == 0
    out = capsys.readouterr().out
    assert f"Checkpoint {a}/2/model\n" in out
    assert f"Plain Orbax checkpoint {a}/2/opt\n" in out
    assert out.endswith(
        "\nOther items of step 2, not read (neither orbax_eqx nor plain Orbax "
        "PyTree items): meta (JsonCheckpointHandler).\n"
    )
    assert main(["inspect", "--json", str(a / "2")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [i["kind"] for i in doc["items"]] == ["orbax_eqx", "plain Orbax"]
    (other,) = doc["others"]
    assert other["name"] == "meta" and other["path"] == str(a / "2" / "meta")
    assert other["handler"].endswith(".JsonCheckpointHandler")


def test_verify_a_step_of_several_kinds(roots, capsys):
    a, _, _ = roots
    assert main(["verify", str(a / "2")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"4 of 4 arrays (52 B) in {a}/2/model match their checksums."
    assert out[1].startswith(f"5 of 5 arrays (68 B) in {a}/2/opt read back whole.")
    assert out[2] == (
        f"2 items of {a}/2: every array matches (or, in plain Orbax items, reads back)."
    )


def test_diff_two_roots_item_by_item(roots, capsys):
    a, b, _ = roots
    assert main(["diff", str(a), str(b)]) == 1
    assert capsys.readouterr().out == (
        f"A: {a}/2 (the latest step of the CheckpointManager root {a})\n"
        f"B: {b}/2 (the latest step of the CheckpointManager root {b})\n"
        "\n"
        "Items: 2 differences\n"
        "  difference    item  A -> B\n"
        "  item added    data  (absent) -> JsonCheckpointHandler\n"
        "  item removed  meta  JsonCheckpointHandler -> (absent)\n"
        "\n"
        "Item model:\n"
        f"  A: {a}/2/model\n"
        f"  B: {b}/2/model\n"
        "\n"
        "  Structure: the same (4 leaves, 1 modules).\n"
        "\n"
        "Item opt:\n"
        f"  A: {a}/2/opt\n"
        f"  B: {b}/2/opt\n"
        "\n"
        "  Structure: the same (5 leaves; a plain Orbax checkpoint records arrays "
        "only, so modules were not compared).\n"
        "\n"
        "A and B differ: 2 in which items they hold. Array values were not "
        "compared: pass --values to compare them.\n"
    )
    assert main(["diff", str(a / "2"), str(b / "1"), "--values", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [i["name"] for i in doc["items"]] == ["model", "opt"]
    assert [(d["what"], d["name"]) for d in doc["item_differences"]] == [
        ("item added", "data"),
        ("item removed", "meta"),
    ]
    model = {v["name"]: v for v in doc["items"][0]["values"]["leaves"]}
    # Typed PRNG keys: compared as keys, no magnitude.
    assert model["key"] == {
        "name": "key",
        "max_abs": None,
        "max_rel": None,
        "mismatched": 1,
        "size": 1,
        "keys": True,
    }
    assert doc["items"][1]["differ"] is False  # the optimizer states are equal


def test_diff_values_columns_align_with_long_names(roots, capsys):
    a, b, _ = roots
    assert main(["diff", str(a), str(b), "--item", "model", "--values"]) == 1
    out = capsys.readouterr().out
    lines = out.split("Values (")[1].splitlines()[1:6]
    assert lines[0] == "  max abs  max rel  status                       name"
    assert "        -        -  DIFFERENT (1 of 1 keys)      key" in lines
    assert "        0        0  equal                        " + LONG in lines
    (weight,) = [x for x in lines if x.endswith("  model.weight")]
    assert re.fullmatch(
        r" +\S+ +\S+  DIFFERENT \(6 of 6 elements\)  model\.weight", weight
    )
    # Every row puts its status and its name at the same columns.
    assert {re.match(r" *\S+ +\S+  ", x).end() for x in lines[1:]} == {20}
    assert {len(x) - len(x.split()[-1]) for x in lines} == {len(lines[0]) - 4}


def test_keys_equal_as_keys(tmp_path, capsys):
    tree = {"key": jax.random.split(jax.random.key(5), 4)}
    oeqx.save(tmp_path / "a", tree)
    oeqx.save(tmp_path / "b", tree)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--values"]) == 0
    out = capsys.readouterr().out
    assert "        -        -  equal keys  key\n" in out


def test_item_by_name(roots, capsys):
    a, b, single = roots
    # --item picks in the step; the other side is one item already.
    assert main(["diff", str(a / "2"), str(single), "--item", "model"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"A: {a}/2/model\nB: {single}\n")

    assert main(["diff", str(a / "2"), str(single)]) == 2
    assert capsys.readouterr().err == (
        f"orbax_eqx: error: {a}/2 holds several items (model, opt), and "
        f"{single} is one item: pass --item NAME to compare that item of it, or "
        "give two steps to compare them item by item.\n"
    )
    assert main(["diff", str(a), str(b), "--item", "nope"]) == 2
    assert capsys.readouterr().err == (
        f"orbax_eqx: error: {a} holds no item named 'nope' (--item); it holds "
        "model, opt. Pass one of those.\n"
    )


def test_export_takes_an_item_by_name(roots, tmp_path, capsys):
    a, _, _ = roots
    out = tmp_path / "hf"
    assert main(["export", str(a / "2"), str(out), "--item", "model"]) == 0
    assert "Exported 4 tensors" in capsys.readouterr().out
    assert (out / "model.safetensors").exists()
