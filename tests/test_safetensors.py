"""`export` to and `import` from safetensors, checked against the `safetensors`
library's own reader and writer.
"""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import zoo
from entry import main, skeleton_spec
from safetensors import safe_open
from safetensors.numpy import save_file

import orbax_eqx as oeqx

export = oeqx.export_safetensors


KEY = jax.random.key(1)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
KEY_SKELETON = jax.random.key(2)


def _without_int4(item):
    # safetensors has no int4; `test_export_refuses_dtypes_safetensors_lacks`.
    return {k: v for k, v in item.items() if k != "int4"}


def _make(name):
    make = zoo.ZOO[name]
    if name != "dtypes":
        return make, make(KEY)
    return make, _without_int4(make(KEY))


@pytest.mark.parametrize("name", zoo.ZOO, ids=zoo.ZOO)
@pytest.mark.slow
def test_export_then_import_round_trip(tmp_path, name):
    make, item = _make(name)
    oeqx.save(tmp_path / "ckpt", item)
    result = export(tmp_path / "ckpt", tmp_path / "st", max_shard_size=100)
    skeleton = zoo.skeleton(make, KEY_SKELETON)
    if name == "dtypes":
        skeleton = _without_int4(skeleton)
    oeqx.save(tmp_path / "back", oeqx.load_safetensors(tmp_path / "st", skeleton))
    zoo.assert_same(oeqx.restore(tmp_path / "back", skeleton), item)
    # Every file is one the reference library reads, with the names we expect.
    arrays = [r for r in oeqx.metadata(tmp_path / "ckpt").leaves.values()]
    names = {r.name for r in arrays if r.kind == "array"}
    found = set()
    for path in result.files[:-1] if len(result.files) > 1 else result.files:
        with safe_open(path, framework="numpy") as f:
            found |= set(f.keys())
            assert f.metadata()["format"] == "pt"
    assert found == names


def _library_readable(dtype) -> bool:
    # The library's numpy reader has no float8 (numpy itself has none).
    return "float8" not in str(dtype)


def test_export_bytes_match_library_reader(tmp_path):
    item = _without_int4(zoo.dtypes(KEY)) | {
        "f64": np.arange(3, dtype=np.float64) / 3,
        "i64": np.array([2**62 + 1, -3], np.int64),
        "u16": np.arange(4, dtype=np.uint16),
        "fp8_e8m0": np.ones(2, ml_dtypes.float8_e8m0fnu),
        "key": jax.random.key(3),
    }
    item["tied"] = item["f32"]
    oeqx.save(tmp_path / "ckpt", item)
    (out,) = export(tmp_path / "ckpt", tmp_path / "m.safetensors").files
    raw = dict(safetensors.deserialize(Path(out).read_bytes()))
    with safe_open(out, framework="numpy") as f:
        for name, value in item.items():
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                value = jax.random.key_data(value)
            expected = np.asarray(value)
            assert raw[name]["shape"] == list(expected.shape)
            assert bytes(raw[name]["data"]) == expected.tobytes(), name
            if _library_readable(expected.dtype):
                got = f.get_tensor(name)
                assert (
                    got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
                )
    # Each tensor starts at a multiple of its item size, as the library's own
    # writer arranges.
    data = Path(out).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    for name, info in header.items():
        bits = re.match(r"[A-Z]+(\d+)", info["dtype"])  # F32, BF16, F8_E5M2; BOOL
        itemsize = int(bits[1]) // 8 if bits else 1
        assert (8 + length + info["data_offsets"][0]) % itemsize == 0, (name, info)


def test_library_writer_then_import(tmp_path, capsys):
    # A "PyTorch" state_dict, written by the library, loads into an Equinox MLP
    # through a rename map of rules.
    model = eqx.nn.MLP(3, 2, 8, 1, key=KEY)
    tensors = {}
    for i, layer in enumerate(model.layers):
        tensors[f"net.{i}.weight"] = np.asarray(layer.weight, ml_dtypes.bfloat16)
        tensors[f"net.{i}.bias"] = np.asarray(layer.bias, ml_dtypes.bfloat16)
    tensors["net.0.bias"] = tensors["net.0.bias"].astype(ml_dtypes.float8_e4m3fn)
    save_file(tensors, tmp_path / "torch.safetensors", metadata={"format": "pt"})
    (tmp_path / "map.json").write_text(
        json.dumps([[r"net\.(\d+)\.(weight|bias)", r"layers.\1.\2"]])
    )
    skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 8, 1, key=KEY_SKELETON)
    bf16 = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        skeleton,
    )
    rename = ["--rename", str(tmp_path / "map.json")]
    assert (
        main(
            [
                "import",
                str(tmp_path / "torch.safetensors"),
                str(tmp_path / "x"),
                "--skeleton",
                skeleton_spec(bf16),
                *rename,
            ]
        )
        == 2
    )
    assert re.fullmatch(
        r"orbax_eqx: error: The skeleton does not fit the safetensors at \S+ \(1 "
        r"problem\):\n  - Tensor `net\.0\.bias` \(leaf `layers\.0\.bias`\) is "
        r"float8_e4m3fn in the tensors, but the skeleton has bfloat16\.\nPass --cast "
        r"to cast tensors to the skeleton's dtypes\.\n",
        capsys.readouterr().err,
    )
    assert (
        main(
            [
                "import",
                str(tmp_path / "torch.safetensors"),
                str(tmp_path / "ckpt"),
                "--skeleton",
                skeleton_spec(bf16),
                *rename,
                "--cast",
            ]
        )
        == 0
    )
    restored = oeqx.restore(tmp_path / "ckpt", bf16)
    assert restored.layers[1].weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(restored.layers[1].weight, tensors["net.1.weight"])
    np.testing.assert_array_equal(
        restored.layers[0].bias, tensors["net.0.bias"].astype(ml_dtypes.bfloat16)
    )


def test_export_refuses_dtypes_safetensors_lacks(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", zoo.dtypes(KEY))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"safetensors has no dtype for 1 array\(s\): leaf `int4` is int4\. "
        r"It holds bool, uint8, .*\. Leave them out through `mapping=`, or cast "
        r"them before saving\.",
    ):
        export(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "drop.json").write_text('{"int4": null}')
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    assert main([*argv, "--rename", str(tmp_path / "drop.json")]) == 0
    assert "The rename map left out 1 arrays." in capsys.readouterr().out


def test_export_refuses_the_metadata_name(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"__metadata__": np.ones(2)})
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Leaf `__metadata__` would be the tensor `__metadata__`, a name "
        r"safetensors keeps for its metadata\. Rename it through `mapping=`\.",
    ):
        export(tmp_path / "ckpt", tmp_path / "out")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux only")
@pytest.mark.slow
def test_export_streams_in_bounded_memory(tmp_path):
    """Peak memory of an export grows with --buffer, not with the checkpoint."""
    item = {f"w{i}": np.full((512, 1024), i, np.float32) for i in range(64)}  # 128 MiB
    oeqx.save(tmp_path / "big", item, use_compression=False)
    oeqx.save(tmp_path / "tiny", {"w": np.ones(4, np.float32)})
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent (this
    # pytest process) through fork and exec.
    code = (
        "import sys; from importlib.metadata import entry_points; "
        "(script,) = entry_points(group='console_scripts', name='orbax-eqx'); "
        "rc = script.load()(sys.argv[1:]); "
        "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]); "
        "sys.exit(rc)"
    )

    def peak_kib(*args):
        result = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            cwd=tmp_path,
            # The package under test, not whichever copy is installed.
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _ROOT},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1])

    base = peak_kib("export", "tiny", "--to", "safetensors", "t", "--buffer", "8MiB")
    peak = peak_kib("export", "big", "--to", "safetensors", "b", "--buffer", "8MiB")
    # Holding the checkpoint would take 128 MiB more; streaming holds the buffer
    # and some MiB of TensorStore's own (measured: 22-24 MiB above base).
    assert (peak - base) / 1024 < 64, (base, peak)
    with safe_open(tmp_path / "b" / "model.safetensors", framework="numpy") as f:
        assert float(f.get_tensor("w63")[5, 7]) == 63.0


# ---------------------------------------------------------------- the format


def _write(path, header, data=b""):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda p: p.write_bytes(b"abc") and p,
            r"it ends before byte 8, too short for a header",
        ),
        (
            lambda p: p.write_bytes(struct.pack("<Q", 10**6) + b"{}") and p,
            r"the header claims 1000000 bytes, but the file has 10",
        ),
        (
            lambda p: p.write_bytes(struct.pack("<Q", 2) + b"{x") and p,
            r"the header is not JSON",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "I4", "shape": [2], "data_offsets": [0, 1]}}, b"a"
            ),
            r"tensor 'x' has dtype 'I4'; this reader knows BOOL, U8",
        ),
        (
            lambda p: _write(
                p,
                {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
                b"abcd",
            ),
            r"tensor 'x' is F32\[2\] \(8 bytes\) but its offsets span 4 bytes",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"ab!"
            ),
            r"the header describes \d+ bytes of file, but it has \d+",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"abc"
            ),
            r"the data of tensor 'x' is not where the header says",
        ),
        (
            lambda p: _write(p, {"__metadata__": {"a": 1}}),
            r"__metadata__ is not a map of strings",
        ),
        (
            lambda p: _write(p, {"__metadata__": 0}),
            r"__metadata__ is not a map of strings",
        ),
        (
            lambda p: _write(p, {"__metadata__": ["a"]}),
            r"__metadata__ is not a map of strings",
        ),
        (
            # Its size overflows int64: 2**62 x 4 elements wrapped to 0 bytes.
            lambda p: _write(
                p, {"x": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}}
            ),
            rf"tensor 'x' is F32\[{2**62}, 4\] \({2**66} bytes\) but its offsets "
            r"span 0 bytes",
        ),
        (
            lambda p: _write(
                p,
                {
                    "x": {
                        "dtype": "F32",
                        "shape": [2**40, 2**40],
                        "data_offsets": [0, 0],
                    }
                },
            ),
            r"tensor 'x' is F32\[1099511627776, 1099511627776\] \(\d+ bytes\)",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [0, 2**70], "data_offsets": [0, 0]}}
            ),
            rf"tensor 'x' has shape \[0, {2**70}\]",
        ),
        # The schema is an allow list: each field's type, bounds and length.
        (
            lambda p: _write(p, {"x": {"shape": [2], "data_offsets": [0, 2]}}, b"ab"),
            r"tensor 'x' has dtype None; this reader knows BOOL",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}
            ),
            r"tensor 'x' has shape \[True\]",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}}
            ),
            r"tensor 'x' has shape \[1, 1, ",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}
            ),
            r"tensor 'x' has data_offsets \[0, 1, 1\]",
        ),
        (
            lambda p: _write(
                p, {"x": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}}
            ),
            r"tensor 'x' has data_offsets \[-1, 0\]",
        ),
    ],
    ids=[
        "short",
        "long-header",
        "not-json",
        "dtype",
        "size",
        "trailing",
        "gap",
        "metadata",
        "metadata-zero",
        "metadata-list",
        "size-wraps-int64",
        "size-past-int64",
        "dimension-past-numpy",
        "no-dtype",
        "bool-dimension",
        "rank-65",
        "three-offsets",
        "negative-offset",
    ],
)
def test_damaged_files_are_refused(tmp_path, make, message):
    path = make(tmp_path / "bad.safetensors")
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"\S+bad\.safetensors is not a valid safetensors file: {message}.*\. "
        r"Re-download or re-export it\.",
    ):
        oeqx.load_safetensors(path, {})


def test_reader_agrees_with_library_writer(tmp_path, capsys):
    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([True, False]),
        "c": np.zeros((0, 4), np.int64),
        "d": np.arange(3).astype(ml_dtypes.float8_e5m2),
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    assert main(["inspect", "--json", str(tmp_path / "x.safetensors")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [f["metadata"] for f in doc["files"]] == [["k"]]
    for name, expected in tensors.items():
        found = doc["tensors"][name]
        assert (found["shape"], found["dtype"]) == (
            list(expected.shape),
            str(expected.dtype),
        )
    skeleton = {n: np.empty(x.shape, x.dtype) for n, x in tensors.items()}
    loaded = oeqx.load_safetensors(tmp_path / "x.safetensors", skeleton)
    for name, expected in tensors.items():
        got = loaded[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes()


# ---------------------------------------------------------------- rename maps


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", r"^In \S+m\.json: The mapping is not valid JSON \("),
        (
            "[1, 2]",
            r"^In \S+m\.json: "
            + re.escape(
                "The mapping's rules: Expected `object`, got `int` - at `$[0]`. Each "
                'rule is an object {"op": ...}; a rename map is {"old": "new" or '
                'null}, or [["regex", "new" or null]].'
            )
            + "$",
        ),
        (
            '[["a", "b"], "c"]',
            r"^In \S+m\.json: The rename map: Expected `array`, got `str` - at "
            r"`\$\[1\]`\.$",
        ),
        (
            '[["(", "x"]]',
            r"^In \S+m\.json: The rename map: Rule 0 of a `rename_regex`: the pattern "
            r"'\(' is not one RE2 takes",
        ),
        (
            '{"nope": "x", "a": "b"}',
            r"^The rename map \S+m\.json does not fit the names: The entry 'nope' of "
            r"rule 0 `.*` matches no name \(the names it sees look like `a`, `b`\); "
            r"`a` and `b` both become `b`\. Fix or remove those entries \(`inspect` "
            r"shows the names\)\.$",
        ),
        (
            '{"a": "c", "b": "c"}',
            r"^The rename map \S+m\.json does not fit the names: `a` and `b` both "
            r"become `c`\. Fix",
        ),
    ],
    ids=["json", "shape", "pair", "regex", "unmatched", "clash"],
)
def test_rename_map_errors(tmp_path, capsys, content, message):
    # The command line's `--rename` map, applied to a checkpoint's names.
    oeqx.save(tmp_path / "ckpt", {"a": np.zeros(2), "b": np.ones(2)})
    (tmp_path / "m.json").write_text(content)
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    assert main([*argv, "--rename", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orbax_eqx: error: ") and err.endswith("\n")
    assert re.search(message, err[len("orbax_eqx: error: ") : -1]), err
    assert not (tmp_path / "out").exists()


def test_rename_rules_first_match_wins_and_null_drops(tmp_path):
    (tmp_path / "m.json").write_text(
        json.dumps([[r"opt_state\..*", None], [r"model\.(.*)", r"\1"], [".*", "x"]])
    )
    item = {"model": {"w": np.zeros(2)}, "opt_state": {"mu": np.ones(2)}}
    oeqx.save(tmp_path / "ckpt", item | {"step": np.full(1, 3)})
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    assert main([*argv, "--rename", str(tmp_path / "m.json")]) == 0
    with safe_open(tmp_path / "out" / "model.safetensors", framework="numpy") as f:
        assert sorted(f.keys()) == ["w", "x"]  # model.w, step; opt_state.mu dropped
        assert f.get_tensor("x").tolist() == [3]


def test_export_overwrite_removes_stale_shards(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.mlp(KEY))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")  # not ours: kept
    sharded = export(tmp_path / "ckpt", tmp_path / "out", max_shard_size=200)
    assert len(sharded.files) > 2
    with pytest.raises(
        oeqx.BridgeError,
        match=r"\S+/out already holds safetensors files \(model-00001-of-0000\d\."
        r"safetensors and \d+ more\)\. Pass `overwrite=True` to replace them",
    ):
        export(tmp_path / "ckpt", tmp_path / "out")
    export(tmp_path / "ckpt", tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


# ---------------------------------------------------------------- import errors


def _exported(tmp_path):
    """A checkpoint of {"model": MLP, "key": key}, exported to `tmp_path/st`."""
    item = {"model": zoo.mlp(KEY), "key": jax.random.key(0)}
    oeqx.save(tmp_path / "ckpt", item)
    export(tmp_path / "ckpt", tmp_path / "st")
    return eqx.filter_eval_shape(lambda: item)


def _two_files(tmp_path):
    save_file({"a": np.ones(1, np.float32)}, tmp_path / "st" / "x.safetensors")
    save_file({"a": np.ones(1, np.float32)}, tmp_path / "st" / "y.safetensors")


@pytest.mark.parametrize(
    "damage, skeleton_change, message",
    [
        (
            lambda p: (p / "back").mkdir(),
            None,
            r"\S+/back already exists\. Pass --overwrite to replace it, or choose "
            r"another output\.",
        ),
        (
            lambda p: (p / "st" / "model.safetensors.index.json").write_text("[]"),
            None,
            r"\S+/model\.safetensors\.index\.json is not a safetensors index \(no "
            r"valid weight_map: .*\)\.",
        ),
        (
            lambda p: (p / "st" / "model.safetensors.index.json").write_text(
                '{"weight_map": {"model.layers.0.bias": "other.safetensors"}}'
            ),
            None,
            r"\S+/model\.safetensors\.index\.json names files that are not there: "
            r"other\.safetensors\. Re-download or re-export the directory\.",
        ),
        (
            lambda p: (p / "st" / "model.safetensors.index.json").write_text(
                '{"weight_map": {"nope": "model.safetensors"}}'
            ),
            None,
            r"\S+/model\.safetensors\.index\.json does not match its files: `nope` is "
            r"in no file, not model\.safetensors\. Re-download or re-export the "
            r"directory\.",
        ),
        (
            lambda p: (p / "st" / "model.safetensors").unlink(),
            None,
            r"\S+/st holds no \.safetensors file\.",
        ),
        (
            lambda p: (p / "st" / "model.safetensors").unlink() or _two_files(p),
            None,
            r"Tensor `a` is in both \S+/x\.safetensors and \S+/y\.safetensors; import "
            r"one of them, or remove the duplicate\.",
        ),
        (
            None,
            lambda s: (
                s
                | {"key": jax.ShapeDtypeStruct((), jax.random.key(0, impl="rbg").dtype)}
            ),
            r"Tensor `key` has shape \(2,\) in the tensors, but the skeleton has "
            r"\(4,\) \(a rbg key array, as its key data uint32\[4\]\)\.\nTyped PRNG "
            r"keys are stored as their key data \(`jax\.random\.key_data`\)",
        ),
        (
            None,
            lambda s: (
                s
                | {
                    "model": eqx.filter_eval_shape(
                        eqx.nn.MLP,
                        3,
                        2,
                        8,
                        2,
                        activation=jax.nn.gelu,
                        use_final_bias=False,
                        key=KEY,
                    )
                }
            ),
            r"\(3 problems\):\n  - Tensor `model\.layers\.2\.bias` is in the tensors, "
            r"but no leaf maps to it\.\n  - Static field `use_final_bias` of module "
            r"`model` is False in the skeleton but True in the files\.\n  - .*\n.*or "
            r"pass --allow-unused to leave them out\.\nPass --ignore-static to keep "
            r"the skeleton's\.",
        ),
    ],
    ids=[
        "out-exists",
        "index-not-json-object",
        "index-file-missing",
        "index-mismatch",
        "empty-dir",
        "duplicate",
        "key-impl",
        "static",
    ],
)
def test_import_errors(tmp_path, capsys, damage, skeleton_change, message):
    skeleton = _exported(tmp_path)
    if damage is not None:
        damage(tmp_path)
    if skeleton_change is not None:
        skeleton = skeleton_change(skeleton)
    spec = skeleton_spec(skeleton)
    assert (
        main(
            ["import", str(tmp_path / "st"), str(tmp_path / "back"), "--skeleton", spec]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert re.fullmatch(f"orbax_eqx: error: (.*\n)*.*{message}.*\n(.*\n)*", err), err
    assert not (tmp_path / "back" / "orbax_eqx.json").exists()


def test_export_needs_no_to_for_its_one_format(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"w": np.arange(3.0, dtype=np.float32)})
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("w"), np.arange(3.0))
    assert "default: safetensors" in _help(capsys)


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    return capsys.readouterr().out


def test_export_into_a_file(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"w": np.ones(2)})
    (tmp_path / "out").write_text("")
    with pytest.raises(
        oeqx.BridgeError,
        match=r"\S+/out is a file\. Give a directory, or a file name ending in "
        r"`\.safetensors` for a single file\.",
    ):
        export(tmp_path / "ckpt", tmp_path / "out")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--max-shard-size", "5XB"],
            r"argument --max-shard-size: expected a size "
            r"such as 5GB, 500MB, 256MiB or 1000000, got '5XB'",
        ),
        (["--buffer", "0"], r"argument --buffer: expected a positive size, got '0'"),
    ],
    ids=["unit", "zero"],
)
def test_export_size_arguments(tmp_path, capsys, args, message):
    from entry import main

    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path), "--to", "safetensors", "out", *args])
    assert exit_.value.code == 2
    assert re.search(r"orbax_eqx export: error: " + message, capsys.readouterr().err)
