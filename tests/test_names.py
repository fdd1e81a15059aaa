"""Leaf names: readable, derived from paths, and never shared by two leaves;
and the storage keys Orbax's store holds them under (docs/guides/format.md)."""

import re
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx


def _recorded(tree, **save):
    with tempfile.TemporaryDirectory() as scratch:
        oeqx.save(Path(scratch) / "ckpt", tree, **save)
        return oeqx.metadata(Path(scratch) / "ckpt")


def names(tree):
    """The leaf names a save records, in the order of the tree's leaves."""
    return list(_recorded(tree).leaves)


def _escape(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace(".", "\\.")
    return "\\" + escaped if re.fullmatch(r"-?[0-9]+|", text) else escaped


def _part(entry) -> str:
    """One part of a name, as docs/guides/format.md says it is made."""
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jax.tree_util.DictKey):
        key = entry.key
        if isinstance(key, str):
            return _escape(key)
        if type(key) is int:
            return str(key)
        return "\\(" + _escape(repr(key)) + ")"
    return "\\(" + _escape(str(entry)) + ")"


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
    oeqx.save(tmp_path / "stored", item, pack=False)
    leaves = oeqx.metadata(tmp_path / "stored").leaves
    key = leaves[long_key].key
    assert len(key) <= 120 and key != long_key
    assert re.fullmatch(r"layer_[A-Za-z0-9_.-]{97}~[0-9a-f]{16}", key), key
    assert leaves["short"].key == "short"
    assert key == sidecars.storage_key(long_key)
    restored = oeqx.restore(tmp_path / "stored", eqx.filter_eval_shape(lambda: item))
    assert float(restored[long_key][2]) == 2.0
    oeqx.save(tmp_path / "ckpt", item)
    assert oeqx.metadata(tmp_path / "ckpt").leaves[long_key].name == long_key
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: item))
    assert float(restored[long_key][2]) == 2.0


def test_storage_keys_are_safe_file_names(tmp_path):
    keys = ["../../etc/passwd", "/abs", "a/b", "ü", "a b", "", "..", "x~y"]
    keys += ["_METADATA", "checkpoint", "orbax_eqx.json", "x.orbax-checkpoint-tmp"]
    item = {k: np.full(2, i, np.int32) for i, k in enumerate(keys)}
    oeqx.save(tmp_path / "ckpt", item, pack=False)
    recorded = oeqx.metadata(tmp_path / "ckpt").leaves
    stored = {leaf.key for leaf in recorded.values()}
    oeqx.save(tmp_path / "root", np.ones(2), pack=False)  # the root's name: ""
    (root,) = oeqx.metadata(tmp_path / "root").leaves.values()
    for key in (*stored, root.key):
        assert "/" not in key and key not in ("", ".", "..")
        assert all(c.isascii() for c in key)
        assert "~" in key or re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", key)
    assert len(stored) == len(keys)
    # Each is the key docs/guides/format.md derives from the leaf's name.
    assert all(leaf.key == sidecars.storage_key(n) for n, leaf in recorded.items())
    assert root.key == sidecars.storage_key("")
    skeleton = {k: np.zeros(2, np.int32) for k in keys}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    assert all(int(restored[k][0]) == i for i, k in enumerate(keys))


@pytest.mark.slow
def test_same_model_same_names_from_skeleton_and_concrete(tmp_path):
    # A skeleton's leaves are named as the concrete model's: it restores them.
    make = zoo.ZOO["optax_state"]
    saved = make(jax.random.key(0))
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = eqx.filter_eval_shape(make, jax.random.key(1))
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), saved)
    assert names(saved) == list(oeqx.metadata(tmp_path / "ckpt").leaves)


@pytest.mark.parametrize("make", sorted(zoo.ZOO), ids=str)
@pytest.mark.slow
def test_names_and_paths_built_on_parents_match_whole_paths(make):
    """A walk builds each name and printed path on its parent's; the result
    is what joining every part of the whole path gives."""
    tree = {
        "model": zoo.ZOO[make](jax.random.key(0)),
        "keys": [{7: jnp.zeros(1), 8: jnp.ones(1)}, {(1, "x"): jnp.ones(1)}],
        "7": [jnp.zeros(1), {"a.b": jnp.ones(1), "": jnp.ones(2)}],
        "also": [zoo.mlp(jax.random.key(1)), zoo.mlp(jax.random.key(2))],
    }
    recorded = list(_recorded(tree).leaves.values())
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    paths = [p for p, _ in flat[0]]
    assert recorded and len(recorded) == len(paths)
    for leaf, path in zip(recorded, paths, strict=True):
        assert leaf.path == (jax.tree_util.keystr(path) or "<root>")
        if make != "batchnorm_state":  # a State's entries are named by owner
            assert leaf.name == ".".join(_part(e) for e in path)
