"""The bridge's errors: every problem at once, each naming the tensor and the
leaf, then fixes that work.
"""

import json
import re
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

import orbax_eqx as oeqx

M = oeqx.StateDictMapping
GPT = M().stack("blocks", "h.{i}").transpose("h.{i}.attn.w")


def _stacked(layers=4):
    return {
        "blocks": {
            "attn": {"w": jax.ShapeDtypeStruct((layers, 3, 2), jnp.float32)},
            "ln": {"w": jax.ShapeDtypeStruct((layers, 2), jnp.float32)},
        },
        "wte": jax.ShapeDtypeStruct((5, 2), jnp.float32),
    }


def _tensors(layers=4):
    out = {"wte": np.zeros((5, 2), np.float32)}
    for i in range(layers):
        out[f"h.{i}.attn.w"] = np.zeros((2, 3), np.float32)
        out[f"h.{i}.ln.w"] = np.zeros((2,), np.float32)
    return out


def test_every_load_problem_at_once():
    tensors = _tensors(5)  # one layer too many
    del tensors["h.1.attn.w"], tensors["h.1.ln.w"]  # a layer missing
    tensors["h.2.attn.w"] = np.zeros((3, 2), np.float32)  # not transposed
    tensors["h.3.attn.w"] = np.zeros((2, 4), np.float32)  # an uneven stack
    tensors["wte"] = np.zeros((5, 2), np.float16)  # dtype
    tensors["h.0.attn.bias"] = np.zeros(1, np.float32)  # a buffer
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.from_state_dict(_stacked(), tensors, GPT)
    text = str(info.value)
    expected = [
        r"The tensors do not fit the skeleton through the mapping \(6 problems\):",
        r"Tensor `wte` is float16 in the tensors, but the mapping expects float32\.",
        r"Tensor `h\.2\.attn\.w` \(leaf `blocks\.attn\.w`, layer 2\) has shape "
        r"\(3, 2\) in the tensors, but the mapping makes \(2, 3\) of the skeleton "
        r"\(the same axes in another order: a `transpose` rule may be missing\)\.",
        r"Tensor `h\.3\.attn\.w` \(leaf `blocks\.attn\.w`, layer 3\) has shape "
        r"\(2, 4\) in the tensors, but the mapping makes \(2, 3\) of the skeleton "
        r"\(an uneven stack: `h\.0\.attn\.w`, \.\.\. and other layers have the "
        r"expected shape\)\.",
        r"Layer 1 is missing from the tensors: none of its 2 tensors is there "
        r"\(`h\.1\.attn\.w`, `h\.1\.ln\.w`; from leaves `blocks\.attn\.w`, "
        r"`blocks\.ln\.w`\)\.",
        r"Layer 4 is in the tensors \(2 tensors, `h\.4\.attn\.w`, `h\.4\.ln\.w`\), but "
        r'the skeleton stacks 4 layers at `\{"op": "stack", "from": "blocks", "to": '
        r'"h\.\{i\}"\}` \(0 to 3\)\.',
        r"Tensor `h\.0\.attn\.bias` is in the tensors, but no leaf maps to it\.",
        r"Pass `cast=True` to cast tensors to the skeleton's dtypes\.",
        r"add an `ignore` rule for them .* or pass `allow_unused=True` to leave "
        r"them out\.",
        r"Build the skeleton with the number of layers the tensors hold\.",
    ]
    for pattern in expected:
        assert re.search(pattern, text), (pattern, text)


def test_one_missing_tensor_is_named_alone():
    tensors = _tensors()
    del tensors["h.2.ln.w"]
    with pytest.raises(
        oeqx.BridgeError,
        match=r"\(1 problem\):\n  - Tensor `h\.2\.ln\.w` \(leaf `blocks\.ln\.w`, "
        r"layer 2\) is missing from the tensors\.\nBuild the skeleton of the model",
    ):
        oeqx.from_state_dict(_stacked(), tensors, GPT)


def test_long_lists_are_capped():
    tensors = _tensors() | {f"extra.{i}": np.zeros(1) for i in range(30)}
    with pytest.raises(oeqx.BridgeError, match=r"\(30 problems\)(?s:.*)and 10 more"):
        oeqx.from_state_dict(_stacked(), tensors, GPT)


def test_unmatched_rules_collisions_and_shapes_at_once():
    tree = {
        "blocks": {"qkv": np.zeros((2, 9, 4)), "scalar": np.zeros(2)},
        "a": np.zeros(3),
        "b": np.zeros(3),
        "fused": np.zeros((7, 2)),
    }
    mapping = (
        M()
        .rename({"a": "same", "b": "same", "nothing": "x"})
        .stack("blocks", "h.{i}")
        .transpose("h.{i}.qkv", (1, 0, 2))
        .split("h.{i}.qkv", ["h.{i}.q", "h.{i}.k"], axis=0, sizes=[4, 4])
        .split("fused", ["f0", "f1"], axis=0)
        .stack("h.{i}.scalar", "h.{i}.s.{j}")
        .cast("nope.**", "bfloat16")
    )
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.to_state_dict(tree, mapping)
    text = str(info.value)
    expected = [
        r"The mapping cannot turn the leaves into tensors \(10 problems\):",
        r'Leaf `a` and leaf `b` both become `same` at rule 0 `\{"op": "rename"',
        r"The entry 'nothing' of rule 0 .* matches no name",
        r"`h\.0\.qkv` \(leaf `blocks\.qkv`, layer 0\) has 2 axes \(shape \(9, 4\)\), "
        r'but rule 2 `\{"op": "transpose", "match": "h\.\{i\}\.qkv", "perm": '
        r"\[1, 0, 2\]\}` permutes 3\.",
        r"`h\.1\.qkv` \(leaf `blocks\.qkv`, layer 1\) has 9 along axis 0, but the "
        r"sizes \[4, 4\] of rule 3 .* sum to 8\.",
        r"`fused` \(leaf `fused`\) has 7 along axis 0, which rule 4 .* cannot split "
        r"into 2 equal parts\.",
        r"`h\.0\.scalar` \(leaf `blocks\.scalar`, layer 0\) has shape \(\), but rule 5 "
        r".* unstacks 1 leading layer axis from it\.",
        r"The pattern 'nope\.\*\*' of rule 6 `\{\"op\": \"cast\", \"match\": "
        r'"nope\.\*\*", "dtype": "bfloat16"\}` matches no name',
        r"Fix the rules that match nothing",  # first of the fixes
        r"Give every tensor its own name",
        r"Give `split` the size of each part",
    ]
    for pattern in expected:
        assert re.search(pattern, text), (pattern, text)


def test_fuse_problems():
    tree = {
        "l0": {"q": np.zeros((2, 3)), "k": np.zeros((2, 3))},
        "l1": {"q": np.zeros((2, 3))},
        "l2": {"k": np.zeros((2, 3))},
        "l3": {"q": np.zeros((2, 3)), "k": np.zeros((2, 4))},
    }
    mapping = (
        M().rename("l{i}", "h.{i}").fuse(["h.{i}.q", "h.{i}.k"], "h.{i}.qk", axis=0)
    )
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.to_state_dict(tree, mapping)
    text = str(info.value)
    for pattern in [
        r"`h\.1\.q` \(leaf `l1\.q`\) is the first part of rule 1 .* but there is no "
        r"`h\.1\.k` to fuse it with\.",
        r"`h\.2\.k` \(leaf `l2\.k`\) is part 1 of rule 1 .* but there is no `h\.2\.q`",
        r"rule 1 .* cannot fuse `h\.3\.q` float64\[2, 3\], `h\.3\.k` float64\[2, 4\] "
        r"into `h\.3\.qk` along axis 0",
    ]:
        assert re.search(pattern, text), (pattern, text)


def test_tie_problems():
    tree = {"wte": np.zeros((3, 2)), "head": np.zeros((3, 2))}
    mapping = M().tie("head", "wte").tie("x", "nowhere")
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.to_state_dict(tree, mapping)
    text = str(info.value)
    assert (
        '`head`, which `{"op": "tie", "tensor": "head", "to": "wte", "export": '
        "false}` ties to `wte`, is also made from leaf `head`." in text
    )
    assert re.search(
        r"`nowhere`, to which .* ties `x`, is no tensor the mapping makes", text
    )
    skeleton = {"wte": np.zeros((3, 2))}
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Tensor `head` is tied to `wte` \(leaf `wte`\) but is float64\[3\] "
        r"where `wte` is float64\[3, 2\]",
    ):
        oeqx.from_state_dict(
            skeleton,
            {"wte": np.zeros((3, 2)), "head": np.zeros(3)},
            M().tie("head", "wte"),
        )


def test_partial_drop_cannot_load():
    tree = {"blocks": {"w": np.zeros((3, 2))}}
    mapping = M().stack("blocks", "h.{i}").drop("h.1.w")
    assert sorted(oeqx.to_state_dict(tree, mapping)) == ["h.0.w", "h.2.w"]  # exports
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Leaf `blocks\.w` is left out in part by the mapping \(as `h\.1\.w`\): "
        r"a load would fill only part of it\.\nDrop whole leaves only",
    ):
        oeqx.from_state_dict(
            tree, {"h.0.w": np.zeros(2), "h.2.w": np.zeros(2)}, mapping
        )


def test_dropped_leaf_of_an_abstract_skeleton():
    skeleton = {
        "w": jax.ShapeDtypeStruct((2,), jnp.float32),
        "freqs": jax.ShapeDtypeStruct((3,), jnp.float32),
    }
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Leaf `freqs` is dropped by the mapping, and the skeleton holds a "
        r"jax\.ShapeDtypeStruct there, which has no value to keep\.\nA leaf the "
        r"mapping drops keeps the skeleton's value",
    ):
        oeqx.from_state_dict(
            skeleton, {"w": np.zeros(2, np.float32)}, M().drop("freqs")
        )


def test_tensors_that_are_not_arrays():
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Some tensors are not named arrays:\n  - The key 3 is int, not a "
        r"name\.\n  - Tensor `b` is a list, not a numpy or jax array\.\nPass a dict",
    ):
        oeqx.from_state_dict({"a": np.zeros(1)}, {3: np.zeros(1), "b": [1.0]})
    with pytest.raises(oeqx.BridgeError, match=r"`tensors` is a list: pass a dict"):
        oeqx.from_state_dict({"a": np.zeros(1)}, [np.zeros(1)])


class Tensor:
    """Stands in for `torch.Tensor` (orbax_eqx never imports PyTorch, and tells
    its tensors by their type's module and name)."""

    __module__ = "torch"
    dtype = "torch.float32"
    shape = (2,)


class Parameter(Tensor):
    __module__ = "torch.nn.parameter"


def test_pytorch_tensors_are_refused_with_numpy_advice():
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^Some tensors are not named arrays:\n  - Tensor `w` is a PyTorch "
        r"tensor \(torch\.Tensor\)\.\n  - Tensor `b` is a PyTorch tensor "
        r"\(torch\.nn\.parameter\.Parameter\)\.\nCall `\.numpy\(\)` on each PyTorch "
        r"tensor first \(`v\.detach\(\)\.cpu\(\)\.numpy\(\)` for one that needs "
        r"gradients or sits on a GPU, `v\.float\(\)\.numpy\(\)` for bfloat16, which "
        r"numpy lacks; `cast=True` then casts to the skeleton's dtype\), or read the "
        r"file with `safetensors\.numpy`\.$",
    ):
        oeqx.from_state_dict(
            {"w": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)},
            {"w": Tensor(), "b": Parameter()},
        )


def test_masked_arrays_are_refused(tmp_path):
    masked = np.ma.masked_array(np.zeros(2, np.float32), mask=[0, 1])
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^Some tensors are not named arrays:\n  - Tensor `w` is a "
        r"numpy\.ma\.MaskedArray, a subclass of numpy\.ndarray: a load would take "
        r"its data and drop what the subclass adds \(a mask\)\.\nPass a plain array "
        r"of the values you mean: `np\.ma\.getdata\(x\)` \(or `x\.filled\(value\)`\) "
        r"for a masked array, `np\.asarray\(x\)` for other subclasses\.$",
    ):
        oeqx.from_state_dict({"w": np.zeros(2, np.float32)}, {"w": masked})
    # A memory-mapped array adds nothing: it loads as its data.
    mapped = np.memmap(tmp_path / "w.bin", np.float32, "w+", shape=(2,))
    mapped[:] = [1.5, 2.5]
    loaded = oeqx.from_state_dict({"w": np.zeros(2, np.float32)}, {"w": mapped})
    assert loaded["w"].tolist() == [1.5, 2.5]


def test_to_state_dict_of_a_skeleton():
    skeleton = eqx.filter_eval_shape(eqx.nn.Linear, 2, 3, key=jax.random.key(0))
    with pytest.raises(
        oeqx.BridgeError,
        match=r"`to_state_dict` needs every array's values on this process:\n  - Leaf "
        r"`weight` is a jax\.ShapeDtypeStruct, which holds no values\.",
    ):
        oeqx.to_state_dict(skeleton)


class _Keyed(eqx.Module):
    w: jax.Array = eqx.field(metadata={"state_dict_key": 3})


class _Plain(eqx.Module):
    w: jax.Array


def test_field_key_problems(tmp_path):
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Some field keys are not names:\n  - Field `w` of `_Keyed` has "
        r"state_dict_key=3, not a string\.",
    ):
        oeqx.to_state_dict(_Keyed(jnp.zeros(1)), M().field_keys())
    with pytest.raises(
        oeqx.BridgeError,
        match=r"The `field_keys` rule of key 'sd' finds no field declared with "
        r'`eqx\.field\(metadata=\{"sd": \.\.\.\}\)`',
    ):
        oeqx.to_state_dict(_Plain(jnp.zeros(1)), M().field_keys("sd"))
    # Planned on names alone, without the tree to read keys from: the export
    # of a checkpoint.
    oeqx.save(tmp_path / "ckpt", {"w": np.zeros(1)})
    with pytest.raises(
        oeqx.BridgeError,
        match=r"reads field metadata from a tree, but the mapping was applied to "
        r"names only\.\nResolve the mapping against the model first: "
        r"`mapping\.resolve\(model_or_skeleton\)`",
    ):
        oeqx.export_safetensors(
            tmp_path / "ckpt", tmp_path / "out", mapping=M().field_keys()
        )
    assert not (tmp_path / "out").exists()


# ------------------------------------------- values a load must not place


FIX_CAST_VALUES = (
    r"A cast of such values has no defined result: clean them first "
    r"\(`np\.nan_to_num`, `np\.clip` to the range\), or give those leaves a float "
    r"dtype in the skeleton \(or a wider integer one\)\.$"
)
NOT_KEPT = (
    r"  - Tensor `{}` \(leaf `{}`\) holds 2 NaN or infinite values, which a cast "
    r"to int32 cannot keep\.\n  - Tensor `{}` \(leaf `{}`\) holds 1 value outside "
    r"int32's range \[-2147483648, 2147483647\], which a cast to int32 cannot keep\.\n"
)


def _unkeepable():
    """Tensors a cast to int32 cannot keep (NaN, infinities, 1e10; the rest
    in range), a large one placed by the copying threads, and one that fits."""
    big = np.zeros(1 << 19, np.float32)
    big[7] = np.nan
    tensors = {
        "a": np.array([np.nan, 1.0, np.inf], np.float32),
        "b": np.array([[1e10, -2147483648.9], [2147483647.9, -3.7]]),
        "big": big,
        "ok": np.array([-3.7, 2.9, 1e9], np.float32),
    }
    skeleton = {n: jax.ShapeDtypeStruct(x.shape, jnp.int32) for n, x in tensors.items()}
    return tensors, skeleton


@pytest.mark.parametrize("through", ["memory", "file", "transposed"])
def test_a_cast_refuses_values_it_cannot_keep(tmp_path, through):
    tensors, skeleton = _unkeepable()
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(tensors, path)
    head, error = r"^Some tensors hold", oeqx.BridgeError
    if through == "memory":
        load = lambda sk, **kw: oeqx.from_state_dict(sk, tensors, cast=True, **kw)  # noqa: E731
    else:
        head = rf"^Some tensors of the safetensors at {re.escape(str(path))} hold"
        load = lambda sk, **kw: oeqx.load_safetensors(path, sk, cast=True, **kw)  # noqa: E731
    kw = {}
    if through == "transposed":  # a cast of a transposed copy
        kw["mapping"] = M().transpose("b")
    with pytest.raises(
        error,
        match=head
        + r" values a cast to the skeleton's dtypes cannot keep:\n"
        + NOT_KEPT.format("a", "a", "b", "b")
        + r"  - Tensor `big` \(leaf `big`\) holds 1 NaN or infinite value, which a "
        r"cast to int32 cannot keep\.\n" + FIX_CAST_VALUES,
    ):
        load(skeleton, **kw)
    # What fits is cast as numpy casts it (the fraction dropped).
    fits = {"ok": skeleton["ok"]}
    loaded = load(fits, allow_unused=True)
    np.testing.assert_array_equal(loaded["ok"], [-3, 2, 1_000_000_000])


def _bool_file(path, data: bytes):
    header = json.dumps(
        {"m": {"dtype": "BOOL", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


FIX_BOOLS = (
    r"A bool is one byte, 0 or 1; any other reads as True on some devices and "
    r"False on others\. Such a tensor is damaged, or was not written as bool \(a "
    r"view of another dtype's bytes\): write it again from its source, or make it "
    r"bools with `x\.view\(np\.uint8\) != 0`\.$"
)


@pytest.mark.parametrize("cast", [False, True], ids=["bool", "cast to int8"])
def test_bool_bytes_other_than_0_and_1_are_refused(tmp_path, cast):
    data = b"\x01\x02\x00\xff"
    path = tmp_path / "m.safetensors"
    _bool_file(path, data)
    dtype = jnp.int8 if cast else jnp.bool_
    skeleton = {"m": jax.ShapeDtypeStruct((4,), dtype)}
    line = r"  - Tensor `m` \(leaf `m`\) holds 2 bytes other than 0 and 1\.\n"
    with pytest.raises(
        oeqx.BridgeError,
        match=rf"^Some bool tensors of the safetensors at {re.escape(str(path))} "
        r"hold bytes other than 0 and 1:\n" + line + FIX_BOOLS,
    ):
        oeqx.load_safetensors(path, skeleton, cast=cast)
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^Some bool tensors hold bytes other than 0 and 1:\n" + line + FIX_BOOLS,
    ):
        oeqx.from_state_dict(skeleton, {"m": np.frombuffer(data, np.bool_)}, cast=cast)
    _bool_file(path, b"\x01\x00\x00\x01")
    loaded = oeqx.load_safetensors(path, skeleton, cast=cast)
    np.testing.assert_array_equal(loaded["m"], [1, 0, 0, 1])


def test_a_shape_dtype_struct_is_no_tensor():
    with pytest.raises(
        oeqx.BridgeError,
        match=r"^Some tensors are not named arrays:\n  - Tensor `w` is a "
        r"ShapeDtypeStruct, not a numpy or jax array\.\nPass a dict",
    ):
        oeqx.from_state_dict(
            {"w": np.ones(2, np.float32)},
            {"w": jax.ShapeDtypeStruct((2,), jnp.float32)},
        )
