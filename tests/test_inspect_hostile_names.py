"""`inspect`'s tree view lays out at most 4,000,000 name parts in all (a
row counts every part of its name): a sidecar naming leaves with huge numbers
of parts (written by hand: no save writes them) gets one line naming the
leaves left out, while the rest of the tree is laid out as usual.

Before the bound, a leaf named with 100,000 parts took minutes (a slice per
part, then 100,000 rows indented by up to 200,000 spaces: 10 GB of text)."""

import json
import re

import jax.numpy as jnp
import pytest
import sidecars
from entry import main

import orbax_eqx as oeqx

MAX_LAID_OUT = 4_000_000  # as docs/guides/cli.md says

LEFT_OUT = (
    r"Not laid out \((\d+)\): (.+): the tree lays out at most "
    + re.escape(f"{MAX_LAID_OUT:,}")
    + r" name parts in all \(a row counts every part of its name\), and these "
    r"names would take it past that\. `inspect --flat` or `--json` lists every "
    r"leaf\."
)


def _renamed(path, names: list[str]) -> None:
    """The sidecar with leaf `a` replaced by leaves `names` (each a record
    like it), then leaf `b`: a tree no save writes."""

    def change(content):
        record = content["leaves"].pop("a")
        for name in names:
            parts = name.split(".")
            leaf_path = "".join(f"['{p}']" for p in parts)
            content["leaves"][name] = {**record, "path": leaf_path}
        content["leaves"]["b"] = content["leaves"].pop("b")

    oeqx.save(path, {"a": jnp.ones(2), "b": jnp.zeros(3)})
    sidecars.edit(path, change)


def _inspect(capsys, *argv) -> str:
    assert main(["inspect", *map(str, argv)]) == 0
    return capsys.readouterr().out


def _leaf_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if "float32" in line]


def test_a_leaf_named_with_100000_parts_is_left_out(tmp_path, capsys):
    name = ".".join(["x"] * 100_000)
    _renamed(tmp_path / "ckpt", [name])
    out = _inspect(capsys, tmp_path / "ckpt")
    found = re.search(LEFT_OUT, out)
    assert found, out
    assert found.group(1) == "1"
    assert found.group(2) == "x.x.x" + ".x" * 32 + "..."  # cut, not 200,000 chars
    # The rest is laid out as usual; every leaf is still counted.
    assert [row.split() for row in _leaf_rows(out)] == [
        ["b", "float32", "(3,)", "12", "B", "pack", "unsharded"]
    ]
    assert "Total: 2 leaves, 2 arrays, 20 B." in out
    assert max(map(len, out.splitlines())) < 2_000


def test_many_long_names_are_laid_out_up_to_the_bound(tmp_path, capsys):
    # Each name is 1,500 parts of its own: 1,125,750 name parts of rows each,
    # so three fit and the other seven would take the view past the bound.
    depth = 1_500
    names = [".".join([f"n{i}"] * depth) for i in range(10)]
    _renamed(tmp_path / "ckpt", names)
    out = _inspect(capsys, tmp_path / "ckpt")
    found = re.search(LEFT_OUT, out)
    assert found, out
    fits = MAX_LAID_OUT // (depth * (depth + 1) // 2)
    assert found.group(1) == str(10 - fits)
    assert found.group(2).startswith(f"n{fits}.n{fits}.")
    assert found.group(2).endswith(f"; and {10 - fits - 3} more")
    rows = _leaf_rows(out)
    assert len(rows) == fits + 1  # the leaves laid out, and `b`
    # Laid out in full: indented by their depth.
    assert rows[0].startswith("  " * (depth - 1) + "  n0 ")


def test_long_shared_prefixes_count_each_row(tmp_path, capsys):
    # 5,000 leaves under one chain 1,000 deep: each new row is 1,001 parts,
    # so the first 3,000-odd leaves are laid out and the rest named.
    prefix = ".".join(["p"] * 1_000)
    names = [f"{prefix}.{i}" for i in range(5_000)]
    _renamed(tmp_path / "ckpt", names)
    out = _inspect(capsys, tmp_path / "ckpt", "--all")
    found = re.search(LEFT_OUT, out)
    assert found, out
    chain = 1_000 * 1_001 // 2
    fits = (MAX_LAID_OUT - chain) // 1_001
    assert found.group(1) == str(5_000 - fits)
    assert len(_leaf_rows(out)) == fits + 1


def test_params_names_what_it_leaves_out(tmp_path, capsys):
    _renamed(tmp_path / "ckpt", [".".join(["x"] * 100_000)])
    out = _inspect(capsys, "--params", tmp_path / "ckpt")
    found = re.search(LEFT_OUT, out)
    assert found, out
    assert found.group(1) == "1"
    assert "Parameters: 5 in 2 arrays" in out  # every leaf still counted


@pytest.mark.parametrize("flag", ["--flat", "--json"], ids=["flat", "json"])
def test_flat_and_json_list_every_leaf(tmp_path, capsys, flag):
    name = ".".join(["x"] * 100_000)
    _renamed(tmp_path / "ckpt", [name])
    out = _inspect(capsys, flag, tmp_path / "ckpt")
    assert "Not laid out" not in out
    if flag == "--json":
        assert set(json.loads(out)["items"][0]["leaves"]) == {name, "b"}
    else:
        assert "x.x.x.x" in out and re.search(r"^\s+b\s", out, re.M)


@pytest.mark.parametrize(
    "keys",
    [["1", "²", "³"], ["0", "1" * 5_000, "2"]],
    ids=["unicode-digits", "5000-digit-key"],
)
def test_dict_keys_that_look_like_indices_do_not_break_folding(tmp_path, capsys, keys):
    # `str.isdigit` says yes to "²" (and `int` then fails), and `int` refuses
    # more than 4,300 digits: neither is a list index, so neither folds.
    oeqx.save(tmp_path / "ckpt", {k: jnp.ones(2) for k in keys})
    out = _inspect(capsys, tmp_path / "ckpt")
    assert " .. " not in out
    assert len(_leaf_rows(out)) == 3
