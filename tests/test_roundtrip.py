"""Every kind of leaf survives save and restore, exactly."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(1)
KEY_SKELETON = jax.random.key(2)


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_roundtrip_into_differently_initialised_skeleton(tmp_path, make):
    item = make(KEY_SAVE)
    other = make(KEY_SKELETON)
    oeqx.save(tmp_path / "ckpt", item)
    restored = oeqx.restore(tmp_path / "ckpt", zoo.skeleton(make, KEY_SKELETON))
    zoo.assert_same(restored, item)
    # A tree built from the skeleton's key differs, so equal values came from disk.
    assert _fingerprint(item) != _fingerprint(other)


def _fingerprint(tree):
    def one(x):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            return np.asarray(x).tobytes()
        return repr(x)

    return [one(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_restore_without_skeleton_gives_flat_dict(tmp_path, make):
    item = make(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item)
    flat = oeqx.restore(tmp_path / "ckpt")
    md = oeqx.metadata(tmp_path / "ckpt")
    assert list(flat) == list(md.leaves)
    n_leaves = len(jax.tree_util.tree_leaves(item, is_leaf=lambda x: x is None))
    assert len(flat) == n_leaves


def test_concrete_model_as_skeleton(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    restored = oeqx.restore(tmp_path / "ckpt", zoo.mlp(KEY_SKELETON))
    zoo.assert_same(restored, model)


def test_tuples_stay_tuples_and_int_keys_stay_ints(tmp_path):
    item = {"t": (jnp.ones(2), 3), "d": {0: jnp.zeros(1), 7: "x"}, "l": [1, 2.5]}
    oeqx.save(tmp_path / "ckpt", item)
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    assert isinstance(restored["t"], tuple) and isinstance(restored["l"], list)
    assert set(restored["d"]) == {0, 7} and restored["d"][7] == "x"


def test_shared_weights_stay_tied(tmp_path):
    model = zoo.shared_tied(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    restored = oeqx.restore(
        tmp_path / "ckpt", zoo.skeleton(zoo.shared_tied, KEY_SKELETON)
    )
    embed, head = restored.shared()
    assert head.weight is embed.weight
    np.testing.assert_array_equal(restored(3), model(3))


def test_batchnorm_state_restores_and_runs(tmp_path):
    model, state = zoo.batchnorm_state(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", (model, state))
    skel = zoo.skeleton(zoo.batchnorm_state, KEY_SKELETON)
    r_model, r_state = oeqx.restore(tmp_path / "ckpt", skel)
    x = jnp.ones((2, 3))
    run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    r_run = jax.vmap(r_model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    np.testing.assert_array_equal(run(x, state)[0], r_run(x, r_state)[0])


def test_same_array_twice_is_stored_once_and_restored_tied(tmp_path):
    w = jnp.arange(6.0).reshape(2, 3)
    item = {"a_encoder": w, "b_decoder": w, "other": jnp.ones(3)}
    oeqx.save(tmp_path / "ckpt", item)
    leaves = oeqx.metadata(tmp_path / "ckpt").leaves
    assert leaves["a_encoder"].data == "packed"
    assert (leaves["b_decoder"].data, leaves["b_decoder"].alias_of) == (
        "alias",
        "a_encoder",
    )
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    assert restored["b_decoder"] is restored["a_encoder"]
    np.testing.assert_array_equal(restored["b_decoder"], w)


def test_cast_loads_float32_weights_into_bfloat16_model(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    skel = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    skel = jax.tree_util.tree_map(
        lambda s: (
            jax.ShapeDtypeStruct(s.shape, jnp.bfloat16)
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        skel,
    )
    restored = oeqx.restore(tmp_path / "ckpt", skel, cast=True)
    assert restored.layers[0].weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        restored.layers[0].weight, model.layers[0].weight.astype(jnp.bfloat16)
    )


def test_int32_beyond_float32_precision_is_not_silently_cast(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"n": jnp.asarray(16777217, jnp.int32)})
    skel = {"n": jax.ShapeDtypeStruct((), jnp.float32)}
    with pytest.raises(oeqx.CheckpointMismatchError, match="dtype float32 in the sk"):
        oeqx.restore(tmp_path / "ckpt", skel)
    assert int(oeqx.restore(tmp_path / "ckpt")["n"]) == 16777217


def test_strict_false_leaves_extra_checkpoint_leaves_unread(tmp_path):
    item = {"model": zoo.mlp(KEY_SAVE), "opt": {"m": jnp.ones(3)}, "step": 4}
    oeqx.save(tmp_path / "ckpt", item)
    skel = {"model": eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)}
    restored = oeqx.restore(tmp_path / "ckpt", skel, strict=False)
    zoo.assert_same(restored, {"model": item["model"]})


def test_relative_paths_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    oeqx.save("rel/ckpt", {"w": jnp.ones(2)})
    assert (tmp_path / "rel" / "ckpt" / "orbax_eqx.json").exists()
    assert float(oeqx.restore("rel/ckpt")["w"][0]) == 1.0


def test_overwrite(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"w": jnp.ones(2)})
    oeqx.save(tmp_path / "ckpt", {"w": jnp.zeros(2)}, overwrite=True)
    assert float(oeqx.restore(tmp_path / "ckpt")["w"][0]) == 0.0


def test_step_directory_with_one_item_is_found(tmp_path):
    oeqx.save(tmp_path / "7" / "default", {"w": jnp.ones(2)})
    assert set(oeqx.restore(tmp_path / "7")) == {"w"}


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "no_ocdbt"])
def test_handler_options(tmp_path, use_ocdbt):
    item = zoo.odd_dict_keys(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item, use_ocdbt=use_ocdbt, use_compression=False)
    restored = oeqx.restore(
        tmp_path / "ckpt", zoo.skeleton(zoo.odd_dict_keys, KEY_SKELETON)
    )
    zoo.assert_same(restored, item)


def test_shardings_function_and_single_sharding(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    seen = []

    def pick(name, leaf):
        seen.append(name)
        return device

    skel = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    restored = oeqx.restore(tmp_path / "ckpt", skel, shardings=pick)
    assert "layers.0.weight" in seen
    assert restored.layers[0].weight.sharding == device
    restored = oeqx.restore(tmp_path / "ckpt", skel, shardings=device)
    zoo.assert_same(restored, model)
    tree = jax.tree_util.tree_map(
        lambda x: device if isinstance(x, jax.ShapeDtypeStruct) else None,
        skel,
        is_leaf=lambda x: x is None,
    )
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skel, shardings=tree), model)
