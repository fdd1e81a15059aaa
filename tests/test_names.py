"""Leaf names: readable, derived from paths, and never shared by two leaves.

Internal modules imported here (`_tree.names`, `_tree.walk`) are the units
these tests pin, or the only way to cause or observe the condition under test;
everything else goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
import zoo

import orbax_eqx as oeqx
from orbax_eqx._tree.names import MAX_STORAGE_KEY, storage_key
from orbax_eqx._tree.walk import walk


def names(tree):
    return [leaf.name for leaf in walk(tree).leaves]


def test_names_join_attributes_indices_and_keys():
    model = zoo.mlp(jax.random.key(0))
    assert names(model)[:2] == ["layers.0.weight", "layers.0.bias"]
    assert "activation" in names(model)
    tree = {"blocks": [zoo.transformer_block(jax.random.key(0))]}
    assert "blocks.0.attn.query_proj.weight" in names(tree)


def test_dotted_key_does_not_collide_with_nested_keys(tmp_path):
    item = {"a.b": jnp.zeros(2), "a": {"b": jnp.ones(2)}}
    assert sorted(names(item)) == ["a.b", "a\\.b"]
    oeqx.save(tmp_path / "ckpt", item)
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    assert float(restored["a.b"][0]) == 0.0 and float(restored["a"]["b"][0]) == 1.0


@pytest.mark.parametrize(
    "tree",
    [
        {"a\\": {"b": 1}, "a\\.b": 2, "a": {"\\": {"b": 3}}},
        {"0": 1, "x": [5, 6], "-3": 2},
        {"": 1, "\\": 2, "\\\\": 3},
        {"x": {0: 1, 1: 2}, "y": {"0": 3, "1": 4}},
        {(1, 2): 1, (1,): 2},
        {"a": {"b": {"c": 1}}, "a.b": {"c": 2}, "a.b.c": 3},
    ],
    ids=["escape_char", "int_like", "empty", "int_vs_str", "tuple_keys", "dots"],
)
def test_names_are_injective(tree):
    leaf_names = names(tree)
    assert len(set(leaf_names)) == len(leaf_names)


def test_int_and_string_digit_keys_differ():
    assert names({"0": 1}) == ["\\0"]
    assert names({0: 1}) == ["0"]


def test_state_entries_are_named_after_their_layer():
    model, state = zoo.batchnorm_state(jax.random.key(0))
    leaf_names = names({"model": model, "state": state})
    state_names = [n for n in leaf_names if n.startswith("state.")]
    assert state_names == [
        "state.bn.batch_counter",
        "state.bn.batch_state_index.0",
        "state.bn.batch_state_index.1",
    ]


def test_state_entries_are_named_the_same_wherever_the_state_is():
    # Relative to the State, not to where its model happens to be in the tree.
    model, state = zoo.batchnorm_state(jax.random.key(0))
    alone = names(state)
    assert alone == [
        "bn.batch_counter",
        "bn.batch_state_index.0",
        "bn.batch_state_index.1",
    ]
    for tree, where in [
        ((model, state), "1."),
        ({"net": {"deep": model}, "s": state}, "s."),
        ({"s": state}, "s."),
    ]:
        assert [n for n in names(tree) if n.startswith(where)] == [
            where + n for n in alone
        ]


def test_overlong_names_get_short_storage_keys(tmp_path):
    long_key = "layer_" * 100
    item = {long_key: jnp.arange(3.0), "short": jnp.ones(1)}
    key = storage_key(long_key)
    assert len(key) <= MAX_STORAGE_KEY and key != long_key
    assert storage_key("short") == "short"
    oeqx.save(tmp_path / "ckpt", item)
    assert oeqx.metadata(tmp_path / "ckpt").leaves[long_key].name == long_key
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    assert float(restored[long_key][2]) == 2.0


def test_storage_keys_are_safe_file_names():
    for name in ["../../etc/passwd", "/abs", "a/b", "ü", "a b", "", "..", "x~y"]:
        key = storage_key(name)
        assert "/" not in key and key not in ("", ".", "..")
        assert all(c.isascii() for c in key)


@pytest.mark.slow
def test_same_model_same_names_from_skeleton_and_concrete():
    make = zoo.ZOO["optax_state"]
    assert names(make(jax.random.key(0))) == names(
        eqx.filter_eval_shape(make, jax.random.key(1))
    )


@pytest.mark.parametrize("make", sorted(zoo.ZOO), ids=str)
@pytest.mark.slow
def test_names_and_paths_built_on_parents_match_whole_paths(make):
    """A walk builds each name and printed path on its parent's; the result
    is what joining every part of the whole path gives."""
    from orbax_eqx._tree.names import join, key_part

    tree = {
        "model": zoo.ZOO[make](jax.random.key(0)),
        "keys": [{7: jnp.zeros(1), 8: jnp.ones(1)}, {(1, "x"): jnp.ones(1)}],
        "7": [jnp.zeros(1), {"a.b": jnp.ones(1), "": jnp.ones(2)}],
        "also": [zoo.mlp(jax.random.key(1)), zoo.mlp(jax.random.key(2))],
    }
    walked = walk(tree)
    assert walked.leaves
    for leaf in walked.leaves:
        assert leaf.path_str == (jax.tree_util.keystr(leaf.path) or "<root>")
        if make != "batchnorm_state":  # a State's entries are named by owner
            assert leaf.name == join([key_part(e) for e in leaf.path])
