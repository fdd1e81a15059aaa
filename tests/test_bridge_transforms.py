"""Each rule of a state_dict mapping, both ways, on explicit cases.

`to_state_dict` must give what numpy computes by hand; `from_state_dict`
must give the leaves back bitwise, into a differently initialised model (the
plan's box queries, a device's shard of a leaf or of a tensor:
`tests/test_read_plans.py`).
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_eqx as oeqx

M = oeqx.StateDictMapping


def _arange(*shape, dtype=np.float32):
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def _round_trip(tree, mapping, expected: dict):
    """`tree` exports to `expected` exactly, and `expected` loads back into a
    zeroed copy of `tree` as `tree`."""
    out = oeqx.to_state_dict(tree, mapping)
    assert list(out) == list(expected)
    for name, value in expected.items():
        assert out[name].dtype == np.asarray(value).dtype, name
        np.testing.assert_array_equal(out[name], value, err_msg=name)
    zeros = jax.tree.map(lambda x: np.zeros_like(x), tree)
    back = oeqx.from_state_dict(zeros, out, mapping)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return out


def test_identity():
    tree = {"a": _arange(2, 3), "b": {"c": _arange(4)}}
    _round_trip(tree, None, {"a": tree["a"], "b.c": tree["b"]["c"]})


def test_rename_whole_subtrees_longest_entry_wins():
    tree = {
        "embed": {"weight": _arange(2), "bias": _arange(2) + 9},
        "embedding": _arange(3),
        "x": _arange(1),
    }
    mapping = M().rename({"embed": "wte", "embed.weight": "special", "x": "y.z"})
    _round_trip(
        tree,
        mapping,
        {
            "embedding": tree["embedding"],
            "special": _arange(2),
            "wte.bias": _arange(2) + 9,
            "y.z": _arange(1),
        },
    )


def test_rename_with_holes_and_empty_new_name():
    tree = {"h": [{"w": _arange(2)}, {"w": _arange(2) + 5}], "wrap": {"w": _arange(3)}}
    mapping = M().rename({"h.{i}.w": "layers.{i}.weight", "wrap": ""})
    _round_trip(
        tree,
        mapping,
        {
            "layers.0.weight": _arange(2),
            "layers.1.weight": _arange(2) + 5,
            "w": _arange(3),
        },
    )


def test_rename_to_none_drops():
    tree = {"a": _arange(2), "b": _arange(3)}
    out = oeqx.to_state_dict(tree, M().rename("b", None))
    assert list(out) == ["a"]


def test_rename_regex_first_rule_wins():
    tree = {"layers": [{"w": _arange(2)}, {"w": _arange(2) + 1}], "head": _arange(3)}
    mapping = M().rename_regex(
        [(r"layers\.(\d+)\.(.*)", r"h.\1.\2"), ("layers.*", "x"), ("head", "lm_head")]
    )
    with pytest.raises(oeqx.BridgeError, match=r"The pattern 'layers\.\*' of rule 0"):
        oeqx.to_state_dict(tree, mapping)
    mapping = M().rename_regex(
        [(r"layers\.(\d+)\.(.*)", r"h.\1.\2"), ("head", "lm_head")]
    )
    _round_trip(
        tree,
        mapping,
        {"h.0.w": _arange(2), "h.1.w": _arange(2) + 1, "lm_head": _arange(3)},
    )


class _Inner(eqx.Module):
    w: jax.Array = eqx.field(metadata={"state_dict_key": "weight"})
    b: jax.Array


class _Outer(eqx.Module):
    inner: _Inner = eqx.field(metadata={"state_dict_key": "c_attn"})
    wrapper: _Inner = eqx.field(metadata={"state_dict_key": ""})
    plain: jax.Array


def test_field_keys_compose_and_resolve_to_plain_renames():
    tree = _Outer(
        _Inner(jnp.arange(2.0), jnp.arange(3.0)),
        _Inner(jnp.arange(4.0), jnp.arange(5.0)),
        jnp.arange(6.0),
    )
    expected = {
        "b": np.arange(5.0, dtype=np.float32),
        "c_attn.b": np.arange(3.0, dtype=np.float32),
        "c_attn.weight": np.arange(2.0, dtype=np.float32),
        "plain": np.arange(6.0, dtype=np.float32),
        "weight": np.arange(4.0, dtype=np.float32),
    }
    _round_trip(tree, M().field_keys(), expected)
    resolved = M().field_keys().resolve(tree)
    assert [r["op"] for r in resolved.to_json()["rules"]] == ["rename"]
    # The resolved mapping works on names alone: a plain dict of the same leaves.
    plain = {
        "inner": {"w": tree.inner.w, "b": tree.inner.b},
        "wrapper": {"w": tree.wrapper.w, "b": tree.wrapper.b},
        "plain": tree.plain,
    }
    assert sorted(oeqx.to_state_dict(plain, resolved)) == sorted(expected)


def test_stack_one_and_two_axes_and_nested():
    w = _arange(2, 3, 4)
    tree = {"blocks": {"w": w, "b": _arange(2, 3)}}
    one = {f"h.{i}.b": w[i, :, 0] * 0 + tree["blocks"]["b"][i] for i in range(2)}
    one |= {f"h.{i}.w": w[i] for i in range(2)}
    _round_trip(tree, M().stack("blocks", "h.{i}"), dict(sorted(one.items())))
    two = {f"g.{i}.l.{j}.w": w[i, j] for i, j in itertools.product(range(2), range(3))}
    tree2 = {"blocks": {"w": w}}
    _round_trip(tree2, M().stack("blocks", "g.{i}.l.{j}"), two)
    nested = M().stack("blocks", "g.{i}").stack("g.{i}", "g.{i}.l.{j}")
    _round_trip(tree2, nested, two)


def test_stack_of_the_leaf_itself():
    tree = {"pos": _arange(3, 2)}
    _round_trip(
        tree, M().stack("pos", "p.{i}"), {f"p.{i}": tree["pos"][i] for i in range(3)}
    )


def test_transpose_default_and_given_perm():
    tree = {"a": _arange(2, 3), "b": _arange(2, 3, 4)}
    mapping = M().transpose("a").transpose("b", (2, 0, 1))
    _round_trip(tree, mapping, {"a": tree["a"].T, "b": tree["b"].transpose(2, 0, 1)})


def test_split_equal_and_unequal():
    w = _arange(8, 3)
    tree = {"qkv": w, "x": _arange(2, 6)}
    mapping = (
        M()
        .split("qkv", ["q", "k", "v"], axis=0, sizes=[4, 2, 2])
        .split("x", ["x0", "x1"], axis=-1)
    )
    expected = {
        "k": w[4:6],
        "q": w[:4],
        "v": w[6:],
        "x0": tree["x"][:, :3],
        "x1": tree["x"][:, 3:],
    }
    _round_trip(tree, mapping, expected)


def test_fuse_along_an_axis():
    tree = {"q": _arange(2, 3), "k": _arange(1, 3) + 100, "v": _arange(2, 3) + 200}
    mapping = M().fuse(["q", "k", "v"], "qkv", axis=0)
    _round_trip(
        tree, mapping, {"qkv": np.concatenate([tree["q"], tree["k"], tree["v"]])}
    )


def test_stack_transpose_split_together():
    """What GPT-2 needs, per layer: a stacked (L, 3d, d) leaf as (d, 3d)
    tensors split in three (and a box query of any device's shard)."""
    w = _arange(3, 6, 2)
    tree = {"blocks": {"qkv": w}}
    mapping = (
        M()
        .stack("blocks", "h.{i}")
        .transpose("h.{i}.qkv")
        .split("h.{i}.qkv", ["h.{i}.q", "h.{i}.k", "h.{i}.v"], axis=1)
    )
    expected = {}
    for i in range(3):
        for n, part in zip(
            "kqv", (w[i].T[:, 2:4], w[i].T[:, :2], w[i].T[:, 4:]), strict=True
        ):
            expected[f"h.{i}.{n}"] = part
    _round_trip(tree, mapping, expected)


def test_cast_on_export_and_back():
    tree = {"a": _arange(4), "i": _arange(3, dtype=np.int32)}
    out = oeqx.to_state_dict(tree, M().cast("a", "bfloat16").cast("i", np.int64))
    assert str(out["a"].dtype) == "bfloat16" and out["i"].dtype == np.int64
    back = oeqx.from_state_dict(tree, out, M().cast("a", "bfloat16").cast("i", "int64"))
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert back["i"].dtype == np.int32


def test_dtype_mismatch_needs_cast():
    tree = {"a": jnp.zeros(3, jnp.float32)}
    tensors = {"a": np.arange(3, dtype=np.float16)}
    with pytest.raises(oeqx.BridgeError, match="Pass `cast=True`"):
        oeqx.from_state_dict(tree, tensors)
    out = oeqx.from_state_dict(tree, tensors, cast=True)
    assert out["a"].dtype == jnp.float32
    np.testing.assert_array_equal(out["a"], [0, 1, 2])


def test_drop_keeps_the_skeletons_value_on_load():
    tree = {"w": jnp.arange(3.0), "freqs": jnp.arange(4.0) + 7}
    mapping = M().drop("freqs")
    out = oeqx.to_state_dict(tree, mapping)
    assert list(out) == ["w"]
    skeleton = {"w": jnp.zeros(3), "freqs": jnp.arange(4.0) + 7}
    back = oeqx.from_state_dict(skeleton, out, mapping)
    np.testing.assert_array_equal(back["freqs"], skeleton["freqs"])
    np.testing.assert_array_equal(back["w"], tree["w"])


def test_ignore_leaves_tensors_alone_on_load_only():
    tree = {"w": _arange(3)}
    mapping = M().ignore(["buffers.**", "*.inv_freq"])
    assert list(oeqx.to_state_dict(tree, mapping)) == ["w"]
    tensors = {"w": _arange(3), "buffers.a.b": _arange(1), "x.inv_freq": _arange(1)}
    np.testing.assert_array_equal(
        oeqx.from_state_dict(tree, tensors, mapping)["w"], _arange(3)
    )


def test_allow_unused():
    tree = {"w": _arange(3)}
    tensors = {"w": _arange(3), "extra": _arange(2)}
    with pytest.raises(oeqx.BridgeError, match="`extra` is in the tensors"):
        oeqx.from_state_dict(tree, tensors)
    oeqx.from_state_dict(tree, tensors, allow_unused=True)


def test_keys_numpy_leaves_and_python_values():
    tree = {
        "key": jax.random.key(3),
        "keys": jax.random.split(jax.random.key(4), 2),
        "np": np.arange(3.0),
        "scalar": np.float32(2.5),
        "n": 7,
        "act": jax.nn.relu,
    }
    out = oeqx.to_state_dict(tree, None)
    assert set(out) == {"key", "keys", "np", "scalar"}
    assert out["keys"].shape == (2, 2) and out["keys"].dtype == np.uint32
    skeleton = eqx.filter_eval_shape(lambda: tree)
    skeleton["np"], skeleton["scalar"] = np.zeros(3), np.float32(0)
    back = oeqx.from_state_dict(skeleton, out)
    assert jax.dtypes.issubdtype(back["keys"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(back["keys"]), jax.random.key_data(tree["keys"])
    )
    assert isinstance(back["np"], np.ndarray) and isinstance(back["scalar"], np.float32)
    assert back["scalar"] == 2.5 and back["n"] == 7 and back["act"] is jax.nn.relu


def test_shardings_given_as_for_restore():
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"w": _arange(2, 3)}
    skeleton = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    back = oeqx.from_state_dict(skeleton, tree, shardings=lambda name, leaf: device)
    assert back["w"].sharding == device
    np.testing.assert_array_equal(back["w"], tree["w"])


# Box queries: any box of a leaf or tensor, from the pieces alone.


@pytest.mark.slow
def test_a_stack_of_a_million_layers_takes_seconds_not_hours():
    """A guard against work per layer that grows with the layers (a quadratic
    planner would take hours here), not a measure of speed: that is
    `benchmarks/mappings.py`'s."""
    import time

    n = 10**6
    tree = {"blocks": {"w": np.arange(n, dtype=np.float32)}}
    start = time.process_time()
    out = oeqx.to_state_dict(tree, M().stack("blocks", "h.{i}"))
    spent = time.process_time() - start
    assert len(out) == n and out["h.999999.w"].shape == () and out["h.7.w"] == 7
    assert list(out)[:3] == ["h.0.w", "h.1.w", "h.2.w"]
    assert spent < 60, f"{spent:.0f} s of CPU for {n} layers"
