"""Names that changed, and checkpoints written before the change.

`eqx.nn.State` entries are named relative to their State, so a State restores
alone; storage keys avoid the names of Orbax's own files. Checkpoints saved
with the names before (the fixtures in `tests/data`, saved by the code of
commit 3578c7d) still restore.

Internal modules imported here (`_tree.names`, `_tree.walk`) are the units
these tests pin, or the only way to cause or observe the condition under test;
everything else goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx
from orbax_eqx._tree.names import old_storage_key, storage_key
from orbax_eqx._tree.walk import walk

DATA = Path(__file__).parent / "data"
KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)


def _old(tmp_path, name):
    """A copy of a fixture checkpoint: restores must not depend on its place."""
    shutil.copytree(DATA / name, tmp_path / name)
    return tmp_path / name


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
        renames=[(r"0\.(.*)", r"net.\1"), (r"1\.(.*)", r"state.\1")],
    )
    zoo.assert_same(restored["state"], state)


@pytest.mark.parametrize(
    "fixture, layout",
    [("old_state_names", "dict"), ("old_state_names_tuple", "tuple")],
)
def test_checkpoints_with_old_state_names_still_restore(tmp_path, fixture, layout):
    path = _old(tmp_path, fixture)
    sidecar = json.loads((path / "orbax_eqx.json").read_text())
    old_name = (
        "state.model.bn.batch_counter" if layout == "dict" else "1.0.bn.batch_counter"
    )
    assert old_name in sidecar["leaves"]  # the fixture has the names of before
    saved = oeqx.restore(path)  # flat: the values on disk, by their old names
    model, state = zoo.batchnorm_state(KEY_SKELETON)
    skeleton = {"model": model, "state": state} if layout == "dict" else (model, state)
    restored, report = oeqx.restore(path, skeleton, report=True)
    restored_state = restored["state"] if layout == "dict" else restored[1]
    prefix = "state.model." if layout == "dict" else "1.0."
    expected = [
        np.asarray(saved[prefix + n]).tobytes()
        for n in [
            "bn.batch_counter",
            "bn.batch_state_index.0",
            "bn.batch_state_index.1",
        ]
    ]
    assert _state_values(restored_state) == expected
    assert _state_values(state) != expected  # read from disk, not the skeleton's
    assert report.renamed == {} and report.unread == ()


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


def test_storage_keys_avoid_orbax_file_names():
    for name in [
        "_METADATA",
        "_sharding",
        "checkpoint",
        "d",
        "ocdbt.process_12",
        "manifest.ocdbt",
        "_Metadata",
        "x.__lock",
    ]:
        assert storage_key(name) != name and "~" in storage_key(name), name
        assert old_storage_key(name) == name
    for name in ["weight", "layers.0.weight", "dd", "checkpoints", "metadata_x"]:
        assert storage_key(name) == name == old_storage_key(name)


def test_checkpoint_with_old_storage_keys_still_restores(tmp_path):
    path = _old(tmp_path, "old_reserved_keys")
    sidecar = json.loads((path / "orbax_eqx.json").read_text())
    assert sidecar["leaves"]["_METADATA"]["key"] == "_METADATA"  # as it was
    expected = {
        "_METADATA": np.arange(3.0, dtype=np.float32),
        "_sharding": np.arange(4.0, dtype=np.float32),
        "checkpoint": np.arange(2.0, dtype=np.float32) + 10,
        "d": np.ones(2, np.float32) * 7,
        "w": np.zeros(2, np.float32),
    }
    skeleton = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expected.items()}
    restored = oeqx.restore(path, skeleton)
    for name, value in expected.items():
        np.testing.assert_array_equal(restored[name], value)
    assert oeqx.verify(path).damaged == ()


def test_a_storage_key_that_is_neither_derivation_is_refused(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"_METADATA": jnp.ones(2)}, pack=False)
    sidecars.edit(
        tmp_path / "ckpt",
        lambda c: c["leaves"]["_METADATA"].update(key="../_METADATA"),
    )
    with pytest.raises(
        oeqx.SidecarError,
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
    names = [leaf.name for leaf in walk({"model": model, "state": state}).leaves]
    assert "state.model.counter.index" in names
    oeqx.save(tmp_path / "ckpt", {"model": model, "state": state})
    skeleton_model = {"counter": _Counter()}
    skeleton = {"model": skeleton_model, "state": eqx.nn.State(skeleton_model)}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    value = restored["state"].get(skeleton_model["counter"].index)
    np.testing.assert_array_equal(value, np.arange(3.0))
