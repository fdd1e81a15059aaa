"""`oeqx.export_safetensors`: trees and checkpoints written as safetensors,
read back with the `safetensors` library; stacked, transposed and fused
layouts; an overwrite killed anywhere (the groups an export writes
together: `tests/test_read_plans.py`).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import orbax_eqx as oeqx

KEY = jax.random.key(0)


def _read_all(out):
    files = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")
    tensors, metadata = {}, []
    for path in files:
        with safe_open(path, framework="numpy") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
            metadata.append(f.metadata())
    return tensors, metadata


def test_a_tree_in_memory(tmp_path):
    model = eqx.nn.MLP(3, 2, 8, 2, key=KEY)
    item = {"model": model, "step": 7, "w": np.arange(6, dtype=np.int16)}
    result = oeqx.export_safetensors(item, tmp_path / "hf")
    assert result.files == [str(tmp_path / "hf" / "model.safetensors")]
    assert (result.tensors, result.modules, result.in_metadata) == (7, 4, 3)
    assert result.nbytes == (3 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2) * 4 + 12
    assert result.left_out == 0
    tensors, (metadata,) = _read_all(tmp_path / "hf")
    np.testing.assert_array_equal(
        tensors["model.layers.1.weight"], model.layers[1].weight
    )
    np.testing.assert_array_equal(tensors["w"], item["w"])
    assert metadata["format"] == "pt"
    ours = json.loads(metadata["orbax_eqx"])
    assert ours["leaves"]["step"] == {"path": "['step']", "kind": "scalar", "value": 7}
    assert ours["modules"]["model"]["static"]["depth"] == 2


def test_sharded_files_and_index(tmp_path):
    item = {f"w{i}": np.full((10,), i, np.float32) for i in range(5)}
    result = oeqx.export_safetensors(item, tmp_path / "hf", max_shard_size=100)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert result.files == [str(tmp_path / "hf" / n) for n in names] + [
        str(tmp_path / "hf" / "model.safetensors.index.json")
    ]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 200}
    assert index["weight_map"] == {
        "w0": names[0],
        "w1": names[0],
        "w2": names[1],
        "w3": names[1],
        "w4": names[2],
    }
    tensors, _ = _read_all(tmp_path / "hf")
    assert {k: float(v[0]) for k, v in tensors.items()} == {
        f"w{i}": float(i) for i in range(5)
    }


def test_refuses_shapes_without_values(tmp_path):
    skeleton = eqx.filter_eval_shape(eqx.nn.Linear, 2, 3, key=KEY)
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^2 leaf\(s\) are shapes without values \(jax\.ShapeDtypeStruct\): "
        r"`weight`; `bias`\. Export a tree of arrays, or a checkpoint's path\.$",
    ):
        oeqx.export_safetensors(skeleton, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


_STACK = oeqx.StateDictMapping().stack("blocks", "h.{i}")
_QK = ["h.{i}.q", "h.{i}.k"]


@pytest.mark.parametrize(
    "names, mapping, reference",
    [
        (["w"], _STACK, lambda x, i: x["w"][i]),
        (["w"], _STACK.transpose("h.{i}.w"), lambda x, i: x["w"][i].T),
        (
            ["q", "k"],
            _STACK.transpose(_QK).fuse(_QK, "h.{i}.w", axis=1),
            lambda x, i: np.concatenate([x["q"][i].T, x["k"][i].T], 1),
        ),
    ],
    ids=["stacked", "stacked-transposed", "fused"],
)
def test_stacked_and_fused_layouts_write_what_they_say(
    tmp_path, names, mapping, reference
):
    rng = np.random.default_rng(0)
    blocks = {n: rng.standard_normal((3, 2, 5)).astype(np.float32) for n in names}
    oeqx.export_safetensors(
        {"blocks": blocks}, tmp_path / "hf", mapping=mapping, max_shard_size=50
    )
    tensors, _ = _read_all(tmp_path / "hf")
    assert len(list((tmp_path / "hf").iterdir())) > 2  # several files, an index
    assert sorted(tensors) == [f"h.{i}.w" for i in range(3)]
    for i in range(3):
        np.testing.assert_array_equal(tensors[f"h.{i}.w"], reference(blocks, i))


def test_export_then_load_on_the_public_api(tmp_path):
    model = eqx.nn.MLP(3, 2, 8, 2, key=KEY)
    item = {"model": model, "scale": jnp.float32(2.0), "steps": 3}
    oeqx.save(tmp_path / "ckpt", item)
    result = oeqx.export_safetensors(tmp_path / "ckpt", tmp_path / "hf.safetensors")
    assert result.files == [str(tmp_path / "hf.safetensors")]
    skeleton = eqx.filter_eval_shape(lambda: item | {"steps": 0})
    loaded = oeqx.load_safetensors(tmp_path / "hf.safetensors", skeleton)
    assert loaded["steps"] == 3  # recorded in the file's __metadata__
    np.testing.assert_array_equal(
        loaded["model"].layers[0].weight, model.layers[0].weight
    )
    assert float(loaded["scale"]) == 2.0


_OVERWRITE = """
import sys
import numpy as np
import orbax_eqx as oeqx

out, value, shard = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
tree = {f"t{i}": np.full((256, 1024), value, np.float32) for i in range(16)}
print("ready", flush=True)
oeqx.export_safetensors(tree, out, max_shard_size=shard, overwrite=True)
"""
_MIB = 1 << 20


def _entries(out) -> dict[str, int]:
    """The names in `out` and their inodes."""
    return {e.name: e.inode() for e in os.scandir(out)}


def _killed_at(out, new_shard: int, when) -> None:
    """Runs an overwriting export of `out` in a child, SIGKILLed as soon as
    `when(entries before, entries now)` holds (or never, if it does not)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    before = _entries(out)
    with subprocess.Popen(
        [sys.executable, "-c", _OVERWRITE, str(out), "2", str(new_shard)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout.readline() == "ready\n", child.stderr.read()[-3000:]
            deadline = time.monotonic() + 120
            while child.poll() is None and time.monotonic() < deadline:
                if when(before, _entries(out)):
                    child.kill()
                    break
            child.wait(timeout=120)
            assert child.returncode in (0, -signal.SIGKILL), child.stderr.read()
        finally:
            if child.poll() is None:
                child.kill()


def _what_loads(out) -> str:
    skeleton = {
        f"t{i}": jax.ShapeDtypeStruct((256, 1024), jnp.float32) for i in range(16)
    }
    try:
        tree = oeqx.load_safetensors(out, skeleton)
    except oeqx.BridgeError as e:
        assert "names files that are not there" in str(e), str(e)
        return "error"
    found = {float(v) for x in tree.values() for v in np.unique(np.asarray(x))}
    assert found in ({1.0}, {2.0}), f"a mix of old and new tensors: {found}"
    return "old" if found == {1.0} else "new"


def _new_file(before, now) -> bool:
    return any(
        n.endswith(".safetensors") and before.get(n) != i for n, i in now.items()
    )


def _index_changed(before, now) -> bool:
    name = "model.safetensors.index.json"
    return before.get(name) != now.get(name)


def _temporary(before, now) -> bool:
    return any(".tmp-" in n for n in now)


@pytest.mark.slow
@pytest.mark.parametrize(
    "old_shard, new_shard",
    [(2 * _MIB, 2 * _MIB), (64 * _MIB, 3 * _MIB), (3 * _MIB, 64 * _MIB)],
    ids=["shards-over-shards", "shards-over-one-file", "one-file-over-shards"],
)
def test_an_overwrite_killed_anywhere_leaves_the_old_set_or_the_new(
    tmp_path, old_shard, new_shard
):
    seen = set()
    for when in (_temporary, _new_file, _index_changed, lambda b, n: False):
        out = tmp_path / when.__name__.strip("<>")
        old = {f"t{i}": np.ones((256, 1024), np.float32) for i in range(16)}
        oeqx.export_safetensors(old, out, max_shard_size=old_shard)
        _killed_at(out, new_shard, when)
        seen.add(_what_loads(out))
    assert "new" in seen  # (the run not killed)


def test_an_overwrite_writes_its_shards_beside_the_old_ones_then_removes_those(
    tmp_path,
):
    tree = {f"t{i}": np.full((256, 1024), 1.0, np.float32) for i in range(4)}
    first = oeqx.export_safetensors(tree, tmp_path, max_shard_size=_MIB)
    assert [os.path.basename(f) for f in first.files][0] == (
        "model-00001-of-00004.safetensors"
    )
    tree = {k: v + 1 for k, v in tree.items()}
    second = oeqx.export_safetensors(
        tree, tmp_path, max_shard_size=_MIB, overwrite=True
    )
    names = [os.path.basename(f) for f in second.files]
    assert re.fullmatch(r"model-00001-of-00004\.[0-9a-f]{8}\.safetensors", names[0])
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    assert _what_loads_4(tmp_path) == {2.0}
    third = oeqx.export_safetensors(tree, tmp_path, overwrite=True)  # one file
    assert (
        sorted(os.listdir(tmp_path))
        == ["model.safetensors"]
        == [os.path.basename(f) for f in third.files]
    )


def _what_loads_4(out) -> set[float]:
    skeleton = {
        f"t{i}": jax.ShapeDtypeStruct((256, 1024), jnp.float32) for i in range(4)
    }
    tree = oeqx.load_safetensors(out, skeleton)
    return {float(v) for x in tree.values() for v in np.unique(np.asarray(x))}


@pytest.mark.parametrize(
    "name, shard",
    [("model.safetensors", None), ("model.safetensors.index.json", _MIB)],
)
def test_a_directory_where_a_file_goes_is_refused_before_writing(tmp_path, name, shard):
    (tmp_path / name).mkdir()
    tree = {f"t{i}": np.ones((256, 1024), np.float32) for i in range(4)}
    size = {} if shard is None else {"max_shard_size": shard}
    with pytest.raises(
        oeqx.BridgeError,
        match=re.escape(
            f"{tmp_path / name} is a directory, where the export writes or replaces "
            "the file of that name. Remove the directory, or choose another output."
        ),
    ):
        oeqx.export_safetensors(tree, tmp_path, overwrite=True, **size)
    assert os.listdir(tmp_path) == [name]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, where one can be mounted (as root, with mount(8))."""
    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here: a full disk needs a small tmpfs")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"no tmpfs can be mounted here ({mounted.stderr.strip()}): a full "
            "disk needs one"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_names_the_file_and_leaves_the_old_one(small_disk):
    old = {"w": np.ones((256, 1024), np.float32)}  # 1 MiB
    oeqx.export_safetensors(old, small_disk)
    new = {"w": np.full((2048, 1024), 2.0, np.float32)}  # 8 MiB
    with pytest.raises(
        oeqx.BridgeError,
        match=re.escape(
            f"No space left on the device to write {small_disk / 'model.safetensors'}"
            ": the file needs 8,3"
        )
        + r"\d\d,\d{3} bytes \(No space left on device\)\. Free space there, or choose "
        "another output; the files already at the output are as they were.",
    ):
        oeqx.export_safetensors(new, small_disk, overwrite=True)
    assert os.listdir(small_disk) == ["model.safetensors"]  # no temporaries
    skeleton = {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32)}
    back = oeqx.load_safetensors(small_disk, skeleton)
    np.testing.assert_array_equal(np.asarray(back["w"]), old["w"])


def test_without_the_safetensors_package_the_extra_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` fails
    with pytest.raises(
        ModuleNotFoundError,
        match=r"^export_safetensors needs the safetensors package, which is not "
        r"installed: pip install 'orbax_eqx\[safetensors\]' \(or pip install "
        r"safetensors\)\.$",
    ):
        oeqx.export_safetensors({"w": np.ones(2, np.float32)}, tmp_path / "out")
    assert not (tmp_path / "out").exists()
