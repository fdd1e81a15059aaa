"""Skeleton mistakes: a restore into a skeleton that does not fit the
checkpoint (another class of the same fields, int keys for str keys, None
for an array, the static half of `eqx.partition`) fails with every
difference named and touches nothing; a concrete model, or a tuple for a
saved list, is a skeleton that works.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from untouched import fails_touching_nothing

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(1)
KEY_SKELETON = jax.random.key(2)


class Saved(eqx.Module):
    x: jax.Array
    y: jax.Array


class Lookalike(eqx.Module):
    x: jax.Array
    y: tuple


def test_lookalike_class_with_same_fields_but_other_structure(tmp_path):
    oeqx.save(tmp_path / "ckpt", Saved(jnp.ones(2), jnp.ones(3)))
    skeleton = Lookalike(
        jax.ShapeDtypeStruct((2,), jnp.float32),
        (jax.ShapeDtypeStruct((3,), jnp.float32),),
    )
    # The checkpoint's `y` has the shape and dtype of the skeleton's `y.0`: the
    # two are one difference, paired.
    match = (
        r"(?s)\(2 differences\).*Leaf `y\.0` is in the skeleton but not in the "
        r"checkpoint; did you mean the checkpoint's `y`, of that shape and dtype, "
        r"which the skeleton lacks\? \(map it with `renames=`\)\..*Module `<root>` "
        r"is `.*Lookalike` in the skeleton but `.*Saved` in the checkpoint\."
    )
    fails_touching_nothing(
        tmp_path, tmp_path / "ckpt", oeqx.CheckpointMismatchError, match, skeleton
    )


@pytest.mark.parametrize(
    "saved, skeleton, match",
    [
        (
            {"0": jnp.ones(2)},
            {0: jax.ShapeDtypeStruct((2,), jnp.float32)},
            r"\(1 difference\):\n  - Leaf `0` is in the skeleton but not in the "
            r"checkpoint; did you mean the checkpoint's `\\0` \(path `\['0'\]`\), of "
            r"that shape and dtype, which the skeleton lacks\? \(map it with "
            r"`renames=`\)\.\n",
        ),
        (
            {0: jnp.ones(2)},
            {"0": jax.ShapeDtypeStruct((2,), jnp.float32)},
            r"\(1 difference\):\n  - Leaf `\\0` \(path `\['0'\]`\) is in the "
            r"skeleton but not in the checkpoint; did you mean the checkpoint's `0`, "
            r"of that shape and dtype, which the skeleton lacks\? \(map it with "
            r"`renames=`\)\.\n",
        ),
        (
            {"w": None, "v": jnp.ones(2)},
            {"w": jax.ShapeDtypeStruct((2,), jnp.float32), "v": jnp.zeros(2)},
            r"Leaf `w` is array float32\[2\] in the skeleton but None in the "
            "checkpoint",
        ),
        (
            zoo.mlp(KEY_SAVE),
            eqx.partition(zoo.mlp(KEY_SKELETON), eqx.is_array)[0],
            r"(?s)Leaf `activation` is None in the skeleton but callable "
            r".*relu in the checkpoint",
        ),
    ],
    ids=["int_key_for_str_key", "str_key_for_int_key", "array_for_none", "params_only"],
)
def test_skeleton_mistakes(tmp_path, saved, skeleton, match):
    oeqx.save(tmp_path / "ckpt", saved)
    fails_touching_nothing(
        tmp_path, tmp_path / "ckpt", oeqx.CheckpointMismatchError, match, skeleton
    )


def test_static_part_only_skeleton_says_arrays_are_missing(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.mlp(KEY_SAVE))
    static = eqx.partition(zoo.mlp(KEY_SKELETON), eqx.is_array)[1]
    fails_touching_nothing(
        tmp_path,
        tmp_path / "ckpt",
        oeqx.CheckpointMismatchError,
        r"(?s)\(6 differences\).*Leaf `layers\.2\.bias` is None in the skeleton "
        r"but array float32\[2\] in the checkpoint.*\nThe skeleton has None where "
        r"the checkpoint has arrays: a skeleton needs each array's shape and dtype\. "
        r"Pass the whole model, or `eqx.filter_eval_shape\(make_model, key\)`, not "
        r"the static half of `eqx.partition\(model, eqx.is_array\)`\.$",
        static,
    )


def test_concrete_model_as_skeleton_gets_the_checkpoint_values(tmp_path):
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", model)
    other = zoo.mlp(KEY_SKELETON)
    assert not np.array_equal(other.layers[0].weight, model.layers[0].weight)
    restored = oeqx.restore(tmp_path / "ckpt", other)
    zoo.assert_same(restored, model)


def test_tuple_skeleton_for_a_saved_list_takes_the_skeletons_structure(tmp_path):
    # Leaf names do not record list vs tuple (`l.0` either way): the skeleton
    # gives the structure, the checkpoint the values.
    saved = {"l": [jnp.ones(2), jnp.arange(3.0)]}
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = {"l": tuple(eqx.filter_eval_shape(lambda: saved)["l"])}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    assert isinstance(restored["l"], tuple)
    np.testing.assert_array_equal(restored["l"][1], saved["l"][1])
