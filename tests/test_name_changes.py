"""How leaves are named: `eqx.nn.State` entries relative to their State, so
that a State restores alone; storage keys that avoid the names of Orbax's own
files."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)


def _state_values(state):
    """A State's values, as bytes, comparable with `==`."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]


# ---------------------------------------------------------- eqx.nn.State names


def test_state_saved_beside_its_model_restores_alone(tmp_path):
    model, state = zoo.batchnorm_state(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", {"model": model, "state": state})
    _, skeleton = zoo.batchnorm_state(KEY_SKELETON)
    assert _state_values(skeleton) != _state_values(state)  # so values are read
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, prefix="state")
    zoo.assert_same(restored, state)
    restored = oeqx.restore(tmp_path / "ckpt", {"state": skeleton}, strict=False)
    zoo.assert_same(restored["state"], state)


def test_state_saved_alone_restores_beside_a_model(tmp_path):
    model, state = zoo.batchnorm_state(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", {"state": state})
    skeleton_model, skeleton_state = zoo.batchnorm_state(KEY_SKELETON)
    restored = oeqx.restore(
        tmp_path / "ckpt",
        {"model": skeleton_model, "state": skeleton_state},
        missing="keep",
        report=True,
    )[0]
    zoo.assert_same(restored["state"], state)


def test_state_in_a_tuple_restores_from_another_layout(tmp_path):
    model, state = zoo.batchnorm_state(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", (model, state))  # the model at `0`, its State `1`
    skeleton_model, skeleton_state = zoo.batchnorm_state(KEY_SKELETON)
    restored = oeqx.restore(
        tmp_path / "ckpt",
        {"net": skeleton_model, "state": skeleton_state},
        renames=oeqx.StateDictMapping().rename_regex(
            [(r"net\.(.*)", r"0.\1"), (r"state\.(.*)", r"1.\1")]
        ),
    )
    zoo.assert_same(restored["state"], state)


# -------------------------------------------------- storage keys vs Orbax's files

# Leaves named like what Orbax writes beside stored arrays; dotted ones come
# from nested dicts.
ORBAX_NAMED = {
    "_METADATA": jnp.arange(3.0),
    "_sharding": jnp.arange(4.0),
    "checkpoint": jnp.arange(2.0) + 10,
    "array_metadatas": jnp.ones(5),
    "d": jnp.ones(2) * 7,
    "descriptor": jnp.ones(1),
    "_metadata": jnp.zeros(3),
    "manifest": {"ocdbt": jnp.ones(3) * 2},
    "ocdbt": {"process_0": jnp.ones(2) * 3},
    "_sharding.__lock": jnp.ones(2) * 4,  # what TensorStore writes on the way
    "w": jnp.zeros(2),
}


@pytest.mark.parametrize("ocdbt", [False, True], ids=["no-ocdbt", "ocdbt"])
def test_leaves_named_like_orbax_files_save_and_restore(tmp_path, ocdbt):
    oeqx.save(tmp_path / "ckpt", ORBAX_NAMED, pack=False, use_ocdbt=ocdbt)
    skeleton = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ORBAX_NAMED
    )
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), ORBAX_NAMED)
    assert oeqx.verify(tmp_path / "ckpt").damaged == ()
    sidecar = json.loads((tmp_path / "ckpt" / "orbax_eqx.json").read_text())
    assert sidecar["leaves"]["_METADATA"]["key"].startswith("_METADATA~")
    assert sidecar["leaves"]["w"]["key"] == "w"


def test_storage_keys_avoid_orbax_file_names(tmp_path):
    names = [
        "_METADATA",
        "_sharding",
        "checkpoint",
        "d",
        "ocdbt.process_12",
        "manifest.ocdbt",
        "_Metadata",
        "x.__lock",
    ]
    plain = ["weight", "layers.weight", "dd", "checkpoints", "metadata_x"]
    tree: dict = {}
    for name in names + plain:  # nested dicts: the leaf name is `name`
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = np.arange(2.0)
    oeqx.save(tmp_path / "ckpt", tree, pack=False)
    leaves = oeqx.metadata(tmp_path / "ckpt").leaves
    for name in names:
        assert leaves[name].key != name and "~" in leaves[name].key, name
    for name in plain:
        assert leaves[name].key == name


def test_a_storage_key_that_is_neither_derivation_is_refused(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"_METADATA": jnp.ones(2)}, pack=False)
    sidecars.edit(
        tmp_path / "ckpt",
        lambda c: c["leaves"]["_METADATA"].update(key="../_METADATA"),
    )
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"leaf '_METADATA' has storage key '\.\./_METADATA', expected "
        r"'_METADATA~[0-9a-f]{16}'",
    ):
        oeqx.restore(tmp_path / "ckpt")


class _Counter(eqx.Module):
    index: eqx.nn.StateIndex

    def __init__(self):
        self.index = eqx.nn.StateIndex(jnp.zeros(3))


def test_state_made_without_make_with_state_is_named_after_its_owner(tmp_path):
    # Its markers are bare objects, which say nothing: the owner's name is used,
    # as before.
    model = {"counter": _Counter()}
    state = eqx.nn.State(model)
    state = state.set(model["counter"].index, jnp.arange(3.0))
    oeqx.save(tmp_path / "ckpt", {"model": model, "state": state})
    assert "state.model.counter.index" in oeqx.metadata(tmp_path / "ckpt").leaves
    skeleton_model = {"counter": _Counter()}
    skeleton = {"model": skeleton_model, "state": eqx.nn.State(skeleton_model)}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    value = restored["state"].get(skeleton_model["counter"].index)
    np.testing.assert_array_equal(value, np.arange(3.0))
