"""`inspect`, `verify` and `diff` on plain Orbax checkpoints: written by Orbax's
own handlers (PyTree, Standard; OCDBT or not; zarr v2 or v3; v0 and v1), read
from Orbax's public metadata and TensorStore specs it builds, a block at a
time (its blocks of whole chunks: `tests/test_read_plans.py`).
"""

import json
import math
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from entry import main
from etils import epath

import orbax_eqx as oeqx

MODEL = eqx.nn.Linear(3, 2, key=jax.random.key(0))


def _tree():
    return {
        "model": eqx.filter(MODEL, eqx.is_array),
        "step": 3,
        "table": np.arange(3, dtype=np.int32),
    }


def write(kind: str, path, tree=None, **save_args):
    """A plain Orbax checkpoint of `tree` at `path`, as `kind` writes it;
    returns its item directory."""
    tree = _tree() if tree is None else tree
    path = epath.Path(path)
    if kind == "pytree":
        with ocp.PyTreeCheckpointer() as c:
            c.save(path, tree, **save_args)
    elif kind == "pytree-no-ocdbt":
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as c:
            c.save(path, tree, **save_args)
    elif kind == "pytree-zarr3":
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as c:
            c.save(path, tree, **save_args)
    elif kind == "standard":
        with ocp.StandardCheckpointer() as c:
            c.save(path, tree)
    elif kind == "v1":
        ocp.v1.save(path, tree)
        return path / "state"
    elif kind == "manager":
        with ocp.CheckpointManager(path) as mngr:
            mngr.save(7, args=ocp.args.StandardSave(tree))
            mngr.wait_until_finished()
        return path / "7" / "default"
    return path


KINDS = {
    # kind: (handler as shown, layout)
    "pytree": ("PyTreeCheckpointHandler", "OCDBT, zarr v2"),
    "pytree-no-ocdbt": ("PyTreeCheckpointHandler", "no OCDBT, zarr v2"),
    "pytree-zarr3": ("PyTreeCheckpointHandler", "OCDBT, zarr v3"),
    "standard": ("StandardCheckpointHandler", "OCDBT, zarr v2"),
    "v1": ("PyTreeHandler (Orbax v1)", "OCDBT, zarr v3"),
    "manager": ("StandardCheckpointHandler", "OCDBT, zarr v2"),
}

TABLE = """\
  name      type     shape   bytes  sharding               value
  model                       32 B
    bias    float32  (2,)      8 B  single device (cpu:0)
    weight  float32  (2, 3)   24 B  single device (cpu:0)
  step      int64    ()        8 B                         Python scalar
  table     int32    (3,)     12 B                         numpy array
"""


@pytest.mark.parametrize("kind", list(KINDS), ids=list(KINDS))
def test_inspect_lists_every_array(tmp_path, capsys, kind):
    item = write(kind, tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    handler, layout = KINDS[kind]
    expected = (
        f"Plain Orbax checkpoint {item}\n"
        f"Written by {handler}; arrays stored with {layout}.\n\n"
        + TABLE
        + "\nTotal: 4 arrays, 52 B.\n"
        "Orbax recorded arrays only: no classes, static fields or Python values. "
        "`oeqx.restore(path, skeleton)` restores it into a skeleton.\n"
    )
    assert out.endswith(expected), out
    if kind == "manager":  # the root: its steps first, then the latest
        assert out.startswith(
            f"CheckpointManager root {tmp_path / 'ckpt'}: 1 step(s)\n"
        )

    assert main(["inspect", "--json", str(tmp_path / "ckpt")]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["items"]
    assert doc["kind"] == "plain Orbax" and doc["path"] == str(item)
    assert doc["handler"].endswith(handler.split()[0])
    assert (doc["ocdbt"], doc["zarr3"]) == ("no OCDBT" not in layout, "v3" in layout)
    assert doc["leaves"]["model.weight"] | {"key": None} == {
        "path": "['model']['weight']",
        "kind": "array",
        "shape": [2, 3],
        "dtype": "float32",
        "nbytes": 24,
        "container": "jax",
        "data": "orbax",
        "sharding": "single device (cpu:0)",
        "key": None,
    }
    assert doc["totals"] == {"leaves": 4, "arrays": 4, "nbytes": 52}


@pytest.mark.parametrize("kind", list(KINDS), ids=list(KINDS))
def test_verify_reads_every_array_back(tmp_path, capsys, kind):
    item = write(kind, tmp_path / "ckpt")
    target = item if kind == "manager" else tmp_path / "ckpt"
    assert main(["verify", str(target)]) == 0
    handler, _ = KINDS[kind]
    assert capsys.readouterr().out == (
        f"4 of 4 arrays (52 B) in {item} read back whole. It is a plain Orbax "
        f"checkpoint ({handler}), which records no checksums: every array is "
        "there and decodes, but whether its values changed since the save cannot "
        "be told.\n"
    )
    report = oeqx.verify(item)
    assert report.ok and report.checked == () and report.nbytes == 52
    assert sorted(report.unchecked) == ["model.bias", "model.weight", "step", "table"]


@pytest.mark.parametrize("kind", ["pytree", "pytree-no-ocdbt", "v1"])
def test_diff_against_an_orbax_eqx_checkpoint(tmp_path, capsys, kind):
    item = write(kind, tmp_path / "plain")
    oeqx.save(tmp_path / "eqx", {"model": MODEL, "step": 3, "table": _tree()["table"]})
    args = ["diff", str(tmp_path / "eqx"), str(item), "--values"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Structure: the same (4 leaves; a plain Orbax checkpoint records" in out
    assert out.endswith("A and B do not differ (values within tolerance).\n")

    # Another model: every array differs, and a leaf only the eqx side has.
    other = eqx.nn.Linear(3, 2, key=jax.random.key(1))
    oeqx.save(tmp_path / "other", {"model": other, "step": 3, "extra": jnp.ones(2)})
    assert main(["diff", str(item), str(tmp_path / "other"), "--values"]) == 1
    out = capsys.readouterr().out
    assert "  removed     table  array int32[3] -> (absent)\n" in out
    assert "  added       extra  (absent) -> array float32[2]\n" in out
    assert "DIFFERENT (6 of 6 elements)  model.weight\n" in out
    assert out.endswith("A and B differ: 2 in structure, 2 in values.\n")


def test_two_plain_checkpoints(tmp_path, capsys):
    a = write("standard", tmp_path / "a")
    tree = _tree()
    tree["model"] = eqx.tree_at(lambda m: m.bias, tree["model"], jnp.array([0.5, 0]))
    b = write("pytree-no-ocdbt", tmp_path / "b", tree)
    assert main(["diff", str(a), str(b), "--values", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["differences"] == [] and doc["differ"] is True
    values = {v["name"]: v for v in doc["values"]["leaves"]}
    assert values["model.bias"]["mismatched"] == 2
    assert values["model.weight"]["mismatched"] == 0
    assert values["step"]["max_abs"] == 0


def test_a_lost_chunk_is_damage(tmp_path, capsys):
    item = write("pytree-no-ocdbt", tmp_path / "ckpt")
    chunks = [p for p in (item / "model.weight").iterdir() if p.name[0].isdigit()]
    assert chunks
    for chunk in chunks:
        chunk.unlink()  # missing data must not read as zeros
    assert main(["verify", str(item)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        f"DAMAGED `model.weight`: cannot be read from Orbax's array store at {item}: "
    )
    assert out.endswith(
        f"1 of 4 arrays in {item} cannot be read (a plain Orbax checkpoint, "
        "PyTreeCheckpointHandler). Restore an earlier step, or re-save the "
        "checkpoint.\n"
    )
    assert main(["inspect", "--stats", str(item)]) == 1
    out = capsys.readouterr().out
    assert (
        f"DAMAGED model.weight: cannot be read from Orbax's array store at {item}: "
        in out
    )


def test_blocks_are_bounded_and_stats_match_numpy(tmp_path, capsys):
    # 64 chunks of 8 x 16 float32 (512 bytes each): blocks of whole chunks.
    x = (
        jax.random.normal(jax.random.key(3), (64, 128))
        .at[0, :3]
        .set(jnp.array([jnp.nan, jnp.inf, 0.0]))
    )
    tree = {"x": x, "i": jnp.arange(1000, dtype=jnp.int32)}
    save_args = {"x": ocp.SaveArgs(chunk_byte_size=4096), "i": ocp.SaveArgs()}
    item = write("pytree", tmp_path / "ckpt", tree, save_args=save_args)
    assert main(["stats", "--json", str(item)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["items"]
    stats = {s["name"]: s for s in doc["stats"]}
    s = stats["x"]
    host = np.asarray(x, np.float64).reshape(-1)
    finite = host[np.isfinite(host)]
    assert (s["nan"], s["inf"], s["zeros"], s["size"]) == (1, 1, 1, x.size)
    assert s["min"] == finite.min() and s["max"] == finite.max()
    assert math.isclose(s["mean"], finite.mean(), rel_tol=1e-12)
    assert math.isclose(s["std"], finite.std(), rel_tol=1e-9)
    assert math.isclose(s["l2"], math.sqrt(np.sum(finite**2)), rel_tol=1e-12)
    assert (stats["i"]["min"], stats["i"]["max"], stats["i"]["mean"]) == (0, 999, 499.5)


def _write_json(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_hostile_metadata_names_outside_the_item(tmp_path, capsys):
    item = write("pytree-no-ocdbt", tmp_path / "ckpt", {"x": jnp.ones(2)})

    def outside(doc):
        (entry,) = doc["tree_metadata"].values()
        entry["key_metadata"][0]["key"] = "/etc"

    _write_json(item / "_METADATA", outside)
    message = (
        f"{item}/_METADATA names arrays outside the checkpoint's directory "
        r"\('/etc'\): Orbax would read their files there\. It is no checkpoint "
        r"Orbax writes; it is not read\."
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.verify(item)
    assert main(["inspect", str(item)]) == 2
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", capsys.readouterr().err)


def test_hostile_metadata_too_large(tmp_path):
    item = write("pytree", tmp_path / "ckpt", {"x": jnp.ones(2)})
    with open(item / "_METADATA", "r+b") as f:
        f.truncate(300 << 20)  # sparse: nothing is allocated
    message = (
        rf"{item}/_METADATA has 314572800 bytes, more than the 268435456 that "
        r"Orbax's metadata of any checkpoint needs: the checkpoint is damaged, or "
        r"not one; it is not read\."
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.verify(item)


def test_hostile_fifo_in_the_store(tmp_path):
    item = write("pytree-no-ocdbt", tmp_path / "ckpt", {"x": jnp.ones(2)})
    os.mkfifo(item / "x" / "1.0")  # a read of it would block forever
    with pytest.raises(oeqx.CheckpointDamagedError, match="FIFO"):
        oeqx.verify(item)


def test_hostile_metadata_shape_does_not_match_the_array(tmp_path, capsys):
    item = write("pytree-no-ocdbt", tmp_path / "ckpt", {"x": jnp.ones(4)})

    def bigger(doc):
        doc["shape"] = [1 << 40]
        doc["chunks"] = [1 << 40]

    # The array's own metadata claims a terabyte in one chunk: never read.
    _write_json(item / "x" / ".zarray", bigger)
    assert main(["verify", str(item)]) == 1
    assert capsys.readouterr().out.startswith(
        "DAMAGED `x`: is stored in chunks of (1099511627776,) (4398046511104 "
        "bytes), more than half of this machine's memory: reading one would not "
        "fit; read it on a larger machine\n"
    )
