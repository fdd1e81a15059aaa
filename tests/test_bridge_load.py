"""`oeqx.load_safetensors` on files written by the `safetensors` library:
values, and every check before any tensor byte is read (what a load reads,
copies and holds: `tests/test_read_plans.py`)."""

import json
import os
import re
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zoo
from safetensors import safe_open
from safetensors.numpy import save_file

import orbax_eqx as oeqx

KEY = jax.random.key(0)
INDEX_FILE = "model.safetensors.index.json"  # Hugging Face's, beside its files
CHECKSUMS = "orbax_eqx.xxh3"  # the metadata entry of an export's checksums


def _values(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _mlp_tensors(model):
    out = {}
    for i, layer in enumerate(model.layers):
        out[f"layers.{i}.weight"] = np.asarray(layer.weight)
        out[f"layers.{i}.bias"] = np.asarray(layer.bias)
    return out


def _skeleton():
    return eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 8, 2, key=jax.random.key(9))


# --------------------------------------------------------------- by name


@pytest.mark.parametrize("layout", ["file", "directory", "index", "list"])
def test_loads_by_name_from_every_layout(tmp_path, layout):
    model = eqx.nn.MLP(3, 2, 8, 2, key=KEY)
    tensors = _mlp_tensors(model)
    names = sorted(tensors)
    if layout == "file":
        save_file(tensors, tmp_path / "m.safetensors")
        source = tmp_path / "m.safetensors"
    else:
        halves = [names[:3], names[3:]]
        files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        for half, f in zip(halves, files, strict=True):
            save_file({n: tensors[n] for n in half}, tmp_path / f)
        if layout == "index":
            weight_map = {
                n: f for half, f in zip(halves, files, strict=True) for n in half
            }
            (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
        source = [tmp_path / f for f in files] if layout == "list" else tmp_path
    loaded = oeqx.load_safetensors(source, _skeleton())
    for got, want in zip(loaded.layers, model.layers, strict=True):
        assert isinstance(got.weight, jax.Array)
        np.testing.assert_array_equal(got.weight, want.weight)
        np.testing.assert_array_equal(got.bias, want.bias)
    assert loaded.activation is jax.nn.relu  # the skeleton's own


@pytest.mark.slow
def test_round_trip_of_the_zoo_through_export_safetensors(tmp_path):
    for name in ("mlp", "prng_keys", "numpy_leaves", "python_scalars", "vmap_stacked"):
        make = zoo.ZOO[name]
        item = make(KEY)
        out = tmp_path / name
        oeqx.export_safetensors(item, out, max_shard_size=300)
        loaded = oeqx.load_safetensors(out, zoo.skeleton(make, jax.random.key(5)))
        zoo.assert_same(loaded, item)


def test_cast_and_numpy_leaves(tmp_path):
    tensors = {
        "w": _values((4, 3), 1).astype(ml_dtypes.bfloat16),
        "n": np.arange(5, dtype=np.int64),
        "s": np.array(2.5, np.float32),
    }
    save_file(tensors, tmp_path / "m.safetensors")
    skeleton = {
        "w": jax.ShapeDtypeStruct((4, 3), jnp.float32),
        "n": np.zeros(5, np.int64),
        "s": np.float32(0),
    }
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^The skeleton does not fit the safetensors at \S+m\.safetensors "
        r"\(1 problem\):\n  - Tensor `w` is bfloat16 in the tensors, but the "
        r"skeleton has float32\.\nPass `cast=True` to cast tensors to the "
        r"skeleton's dtypes\.$",
    ):
        oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton)
    loaded = oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton, cast=True)
    assert loaded["w"].dtype == jnp.float32
    np.testing.assert_array_equal(loaded["w"], tensors["w"].astype(np.float32))
    assert type(loaded["n"]) is np.ndarray
    np.testing.assert_array_equal(loaded["n"], tensors["n"])
    assert type(loaded["s"]) is np.float32 and loaded["s"] == 2.5


def test_every_problem_at_once_before_any_read(tmp_path):
    tensors = {"a": _values((2, 3), 0), "extra": _values((1,), 1)}
    tensors |= {f"z{i}": _values((1,), i) for i in range(5)}
    save_file(tensors, tmp_path / "m.safetensors")
    skeleton = {
        "a": jax.ShapeDtypeStruct((3, 2), jnp.float32),
        "b": jax.ShapeDtypeStruct((1,), jnp.float32),
        "k": jax.ShapeDtypeStruct((), jax.random.key(0).dtype),
    }
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton)
    # Worded as a load through a mapping, or a restore through `renames=`, is.
    assert str(info.value).splitlines() == [
        f"The skeleton does not fit the safetensors at {tmp_path / 'm.safetensors'} "
        "(8 problems):",
        "  - Tensor `a` has shape (2, 3) in the tensors, but the skeleton has (3, 2) "
        "(the same axes in another order: a `transpose` rule may be missing).",
        "  - Tensor `b` is missing from the tensors; did you mean `z4`, of that "
        "shape, which no leaf maps to? (rename `b` to it).",
        "  - Tensor `k` is missing from the tensors.",
        *[
            f"  - Tensor `{name}` is in the tensors, but no leaf maps to it."
            for name in ["extra", "z0", "z1", "z2", "z3"]
        ],
        "If the model's hyperparameters differ (sizes, heads, layers), build the "
        "skeleton with the ones the tensors were made with; if the layout holds "
        "the axes in another order, add a `transpose` rule; if it fuses or splits "
        "tensors, check the `split`/`fuse` sizes.",
        "Build the skeleton of the model the tensors hold, or map tensor names to "
        "leaf names with `mapping=` (each problem names the tensor a leaf reads).",
        "To leave such tensors out, add an `ignore` rule for them (buffers such "
        "as `attn.bias` or `rotary_emb.inv_freq`), or pass `allow_unused=True` to "
        "leave them out.",
    ]


@pytest.mark.parametrize(
    "data, found",
    [
        (
            np.zeros(2, np.uint32),
            r"has shape \(2,\) in the tensors, but the skeleton has ",
        ),
        (np.zeros(4, np.float32), r"is float32 in the tensors, but the skeleton has "),
    ],
    ids=["shape", "dtype"],
)
def test_a_typed_key_of_other_key_data(tmp_path, data, found):
    save_file({"key": data}, tmp_path / "m.safetensors")
    skeleton = {"key": jax.random.key(0, impl="rbg")}
    with pytest.raises(
        oeqx.BridgeError,
        match=r"\(1 problem\):\n  - Tensor `key` " + found + r"\S+ \(a rbg key array, "
        r"as its key data uint32\[4\]\)\.\nTyped PRNG keys are stored as their key "
        r"data \(`jax\.random\.key_data`\), and never cast",
    ):
        oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton, cast=True)


# --------------------------------------------------------------- hostile files


def _raw(path, header, data=b""):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _text(path, text, data=b"", length=None):
    length = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", length) + text + data)
    return path


def _entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    "write, message",
    [
        (
            lambda p: _text(
                p,
                b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
                b"ab",
            ),
            "the header names 'a' twice",
        ),
        (
            lambda p: _raw(p, {"a\x1b[2J": _entry()}, b"abcd"),
            r"the tensor name 'a\\x1b\[2J' holds control characters",
        ),
        (
            lambda p: _raw(p, {"\ud800": _entry()}, b"abcd"),
            r"the tensor name '\\ud800' is not valid Unicode \(a lone surrogate\)",
        ),
        (
            lambda p: _raw(p, {"x" * 5000: _entry()}, b"abcd"),
            r"the tensor name 'x+' \(cut; 5000 characters\) is 5000 characters "
            r"long, more than the 4096 allowed",
        ),
        (
            lambda p: _raw(p, {"a": _entry(shape=[1] * 65)}, b"abcd"),
            r"tensor 'a' has shape \[1, 1, 1",
        ),
        (
            lambda p: _raw(p, {"a": _entry(dtype=5)}, b"abcd"),
            r"tensor 'a' has dtype 5; this reader knows BOOL",
        ),
        (
            lambda p: _raw(p, {"a": _entry(offsets=(0, 4, 8))}, b"abcd"),
            r"tensor 'a' has data_offsets \[0, 4, 8\]",
        ),
        (
            lambda p: _raw(p, {"a": _entry(offsets=(0, True))}, b"abcd"),
            r"tensor 'a' has data_offsets \[0, true\]|has data_offsets \[0, True\]",
        ),
        (
            lambda p: _text(p, b"{}", length=2**63),
            rf"the header claims {2**63} bytes, more than the 100000000 a header "
            "may have",
        ),
        (
            lambda p: _raw(p, {"a": _entry(offsets=(0, 4))}, b"ab"),
            r"the header describes \d+ bytes of file, but it has \d+",
        ),
        (lambda p: _raw(p, [1, 2]), "the header is not a JSON object"),
    ],
    ids=[
        "duplicate",
        "control",
        "surrogate",
        "long-name",
        "rank",
        "dtype-int",
        "offsets-3",
        "offsets-bool",
        "huge-header",
        "short-data",
        "list",
    ],
)
def test_hostile_headers_are_refused(tmp_path, write, message):
    path = write(tmp_path / "bad.safetensors")
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^\S+bad\.safetensors is not a valid safetensors file: {message}.*"
        r"\. Re-download or re-export it\.$",
    ):
        oeqx.load_safetensors(path, {})


@pytest.mark.parametrize(
    "file, shown",
    [
        (
            "../model.safetensors",
            r"'\.\./model\.safetensors', not a file beside the index",
        ),
        ("/etc/passwd", r"'/etc/passwd', not a file beside the index"),
        ("sub/m.safetensors", r"'sub/m\.safetensors', not a file beside the index"),
        (
            "gs://b/m.safetensors",
            r"'gs://b/m\.safetensors', not a file beside the index",
        ),
        (
            ".hidden.safetensors",
            r"'\.hidden\.safetensors', not a file beside the index",
        ),
        ("m.bin", r"'m\.bin', not a file beside the index"),
        (7, r"int 7, not a file name"),
    ],
    ids=["parent", "absolute", "subdirectory", "url", "hidden", "suffix", "int"],
)
def test_hostile_index_is_refused_before_any_file_is_read(tmp_path, file, shown):
    (tmp_path / "hf").mkdir()
    save_file({"w": np.ones(2, np.float32)}, tmp_path / "model.safetensors")
    index = tmp_path / "hf" / INDEX_FILE
    index.write_text(json.dumps({"weight_map": {"w": file}}))
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^{index} names what an index may not: `w` is in {shown}\. An "
        r"index names tensors, and files beside it by plain names "
        r"\(model-00001-of-00002\.safetensors: no `/`, no `\.\.`, no URL\)\. "
        r"Re-download the directory from a source you trust\.$",
    ):
        oeqx.load_safetensors(tmp_path / "hf", {})


def test_hostile_index_tensor_names_and_shapes(tmp_path):
    index = tmp_path / INDEX_FILE
    index.write_text(json.dumps({"weight_map": {"a\nb": "m.safetensors"}}))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"names what an index may not: the tensor name 'a\\nb' holds control "
        r"characters\.",
    ):
        oeqx.load_safetensors(tmp_path, {})
    index.write_text(json.dumps({"weight_map": ["m.safetensors"]}))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"is not a safetensors index \(no valid weight_map: .*weight_map.*\)\.$",
    ):
        oeqx.load_safetensors(tmp_path, {})
    index.write_text(json.dumps({"weight_map": "m.safetensors"}))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"no valid weight_map: .*weight_map",
    ):
        oeqx.load_safetensors(tmp_path, {})
    # The index is read against its schema: whatever else it holds, no more.
    for raw in [
        b'{"metadata": {}}',  # no weight_map
        b'{"weight_map": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
        b'{"weight_map": {"\xff": "m.safetensors"}}',  # not UTF-8
        b"[1, 2]",
    ]:
        index.write_bytes(raw)
        with pytest.raises(oeqx.BridgeError, match=r"no valid weight_map"):
            oeqx.load_safetensors(tmp_path, {})


def test_an_index_too_large_is_refused_unread(tmp_path):
    index = tmp_path / INDEX_FILE
    limit = 64 << 20
    with open(index, "wb") as f:
        f.truncate(limit + 1)
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^{index} is not a safetensors index: it has {limit + 1} bytes, more "
        rf"than the {limit} allowed\.",
    ):
        oeqx.load_safetensors(tmp_path, {})


def test_a_fifo_listed_as_a_file_is_refused_unread(tmp_path):
    os.mkfifo(tmp_path / "f.safetensors")
    with pytest.raises(
        oeqx.BridgeError,
        match=r"f\.safetensors is not a valid safetensors file: it is a FIFO \(named "
        r"pipe\), not a regular file\.",
    ):
        oeqx.load_safetensors([tmp_path / "f.safetensors"], {})


def test_empty_list_of_files(tmp_path):
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^The list of safetensors files is empty\. Give a file, a directory, "
        r"or a non-empty list of files\.$",
    ):
        oeqx.load_safetensors([], {})


def test_header_reads_are_bounded_by_the_file(tmp_path):
    # A header that claims 99 MB in a 10-byte file: refused before a buffer of
    # that size is made (the length is checked first).
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", 99_000_000) + b"{}")
    with pytest.raises(
        oeqx.BridgeError,
        match=r"the header claims 99000000 bytes, but the file has 10\.",
    ):
        oeqx.load_safetensors(path, {})


@pytest.mark.parametrize(
    "shape, transposed",
    [((3, 600, 700), True), ((3, 600, 700), False), ((3, 3, 700), True)],
    ids=["transposed", "contiguous", "narrow"],
)
def test_transposed_and_cast_copies_equal_numpy(tmp_path, shape, transposed):
    # Tiled where the copy transposes (partial tiles at both edges), one copy
    # else; cast to bfloat16 as it is copied.
    x = _values(shape, 0)
    save_file({"w": x}, tmp_path / "m.safetensors")
    want = x.transpose(0, 2, 1) if transposed else x
    skeleton = {"w": jax.ShapeDtypeStruct(want.shape, jnp.bfloat16)}
    mapping = oeqx.StateDictMapping()
    if transposed:
        mapping = mapping.transpose("w", (0, 2, 1))
    got = oeqx.load_safetensors(
        tmp_path / "m.safetensors", skeleton, mapping=mapping, cast=True
    )
    np.testing.assert_array_equal(np.asarray(got["w"]), want.astype(ml_dtypes.bfloat16))


def test_index_naming_too_many_files_is_refused_before_any_request(tmp_path):
    limit = 1 << 16
    weight_map = {f"t{i}": f"f{i}.safetensors" for i in range(limit + 1)}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"index\.json names {limit + 1} files, more than the {limit} a source "
        r"may have\. Re-download or re-export the directory\.$",
    ):
        oeqx.load_safetensors(tmp_path, {})
    del weight_map["t0"]
    weight_map = dict(list(weight_map.items())[:10])
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"names files that are not there: f1\.safetensors, f10\.safetensors, "
        r"f2\.safetensors and more\. Re-download",
    ):
        oeqx.load_safetensors(tmp_path, {})


def test_recorded_metadata_nested_too_deep_is_ignored(tmp_path):
    deep = "[" * 500 + "]" * 500
    text = '{"modules": {"": {"class": "x", "static": {"a": ' + deep + "}}}}"
    save_file(
        {"w": np.ones(2, np.float32)},
        tmp_path / "m.safetensors",
        metadata={"orbax_eqx": text},
    )
    skeleton = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    loaded = oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton)
    np.testing.assert_array_equal(loaded["w"], np.ones(2))


_MANY = """
import json, sys
import jax, numpy as np
import orbax_eqx as oeqx

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
skeleton = {"x": jax.ShapeDtypeStruct((0,), np.float32)}
oeqx.load_safetensors(sys.argv[1], skeleton, allow_unused=True)  # (imports warm)
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
try:
    oeqx.load_safetensors(sys.argv[2], skeleton)
except oeqx.BridgeError as e:
    message = str(e)
print(json.dumps({"peak": status("VmHWM") - base, "message": message}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
@pytest.mark.slow
def test_a_header_of_many_tensors_costs_a_few_times_its_size(tmp_path):
    """A 13 MB header of 200,000 zero-size tensors, none of them wanted: the
    load's peak RSS growth stays within 10x the header, and the problems list
    the first thousand tensors and count the rest."""
    import subprocess
    import sys

    n = 200_000
    entry = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    _raw(tmp_path / "one.safetensors", {"x": entry})
    path = _raw(tmp_path / "many.safetensors", {f"t{i}": entry for i in range(n)})
    root = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _MANY, str(tmp_path / "one.safetensors"), str(path)],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout.splitlines()[-1])
    assert r["peak"] <= 10 * os.path.getsize(path), r["peak"]
    # `x` missing (paired with one `t`), a thousand unexpected each, the rest
    # as one problem.
    assert "(1002 problems)" in r["message"], r["message"][:300]


def test_names_that_hold_what_records_hold_load(tmp_path):
    # The header's fast reading counts records by their "data_offsets" key:
    # a name that holds that text is read the slower way, and loads.
    name = 'w"data_offsets'
    path = _raw(tmp_path / "m.safetensors", {name: _entry()}, b"\0\0\x80?")
    got = oeqx.load_safetensors(
        path, {"w": jax.ShapeDtypeStruct((1,), jnp.float32)}, mapping={"w": name}
    )
    assert float(got["w"][0]) == 1.0


def test_a_zero_size_tensor_named_twice_is_refused(tmp_path):
    path = _text(
        tmp_path / "m.safetensors",
        b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
        b'"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}',
    )
    with pytest.raises(oeqx.BridgeError, match="the header names 'a' twice"):
        oeqx.load_safetensors(path, {})


def test_a_zero_size_tensor_may_share_an_offset(tmp_path):
    # As the reference reader allows: an empty tensor at the offset where a
    # non-empty one starts (or ends) holds no byte of it.
    data = np.arange(2, dtype=np.float32).tobytes()
    header = {
        "e0": _entry(shape=(0,), offsets=(0, 0)),
        "w": _entry(shape=(2,), offsets=(0, 8)),
        "e8": _entry(shape=(0, 3), offsets=(8, 8)),
    }
    path = _raw(tmp_path / "m.safetensors", header, data)
    skeleton = {
        "e0": jax.ShapeDtypeStruct((0,), jnp.float32),
        "w": jax.ShapeDtypeStruct((2,), jnp.float32),
        "e8": jax.ShapeDtypeStruct((0, 3), jnp.float32),
    }
    got = oeqx.load_safetensors(path, skeleton)
    np.testing.assert_array_equal(got["w"], [0.0, 1.0])
    assert got["e0"].shape == (0,) and got["e8"].shape == (0, 3)


def _qkv_export(tmp_path):
    # q, k and v fused into one tensor: each leaf reads a third of it.
    tree = {x: _values((64, 256), i) for i, x in enumerate("qkv")}
    mapping = oeqx.StateDictMapping().fuse(["q", "k", "v"], "qkv", axis=0)
    oeqx.export_safetensors(tree, tmp_path / "hf", mapping=mapping)
    skeleton = {x: jax.ShapeDtypeStruct((64, 256), jnp.float32) for x in "qkv"}
    return tree, mapping, skeleton, tmp_path / "hf" / "model.safetensors"


def _flip(path, at):
    """Flips a bit of byte `at` of a file's tensor data."""
    data = bytearray(path.read_bytes())
    data[8 + struct.unpack("<Q", data[:8])[0] + at] ^= 1
    path.write_bytes(bytes(data))


def test_export_records_block_sums_and_every_byte_read_is_checked(tmp_path):
    tree, mapping, skeleton, path = _qkv_export(tmp_path)
    with safe_open(path, framework="numpy") as f:
        sums = json.loads(f.metadata()[CHECKSUMS])
    block, found = sums["qkv"]
    assert block == 4096 and len(found) == 3 * 64 * 256 * 4 // block
    loaded = oeqx.load_safetensors(tmp_path / "hf", skeleton, mapping=mapping)
    for x in "qkv":
        np.testing.assert_array_equal(np.asarray(loaded[x]), tree[x])
    _flip(path, 2 * 64 * 256 * 4 + 5000)  # in v's third, its block 33
    with pytest.raises(
        oeqx.BridgeError,
        match=re.escape(
            f"1 safetensors file(s) are damaged: their data changed after export "
            f"(a flipped bit on disk, or a damaged copy):\n  - {path}: tensor "
            "`qkv`, bytes 135168-139264: XXH3-64 recorded at export 0x"
        )
        + r"[0-9a-f]{16}, computed from the data now 0x[0-9a-f]{16}\n"
        + re.escape("Re-export them, or download them again; `python -m orbax_eqx"),
    ):
        oeqx.load_safetensors(tmp_path / "hf", skeleton, mapping=mapping)


def test_a_malformed_checksum_entry_names_the_file(tmp_path):
    save_file(
        {"w": np.ones(4, np.float32)}, tmp_path / "m.safetensors", {CHECKSUMS: "{"}
    )
    skeleton = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with pytest.raises(
        oeqx.BridgeError,
        match=re.escape(
            f"{tmp_path / 'm.safetensors'} is damaged: the `orbax_eqx.xxh3` entry "
            "of its __metadata__ is not JSON ("
        ),
    ):
        oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton)
    sums = json.dumps({"w": [4096, []]})
    save_file(
        {"w": np.ones(4, np.float32)}, tmp_path / "m.safetensors", {CHECKSUMS: sums}
    )
    with pytest.raises(
        oeqx.BridgeError,
        match=re.escape(
            "__metadata__ records 0 sums of 4096 bytes for tensor `w` of 16 bytes. "
            "Re-export it, or download it again."
        ),
    ):
        oeqx.load_safetensors(tmp_path / "m.safetensors", skeleton)
