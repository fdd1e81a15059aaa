"""`shardings_from_rules`: rules on leaf names to target shardings.

These run on this process's one device, on a (1, 1) mesh; rules that split a
dimension over more devices (and dimensions that do not divide evenly) are
tested with 8 devices in integration_tests/test_mesh.py.
"""

import re
import shutil

import equinox as eqx
import jax
import pytest
import zoo
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)

RULES = [
    (r"(^|\.)attn\..*\.weight$", P(None, "model")),
    (r"^mlp\.layers\.0\.", P("model")),
    (r".*", P()),
]


@pytest.fixture
def mesh():
    return jax.make_mesh((1, 1), ("data", "model"))


@pytest.fixture
def saved_block(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, zoo.transformer_block(KEY_SAVE))
    return path


def _spec(x):
    assert isinstance(x.sharding, NamedSharding)
    return x.sharding.spec


def test_first_matching_rule_wins(mesh):
    shardings = oeqx.shardings_from_rules(mesh, RULES)
    leaf = jax.ShapeDtypeStruct((8, 8), "float32")
    for name, spec in [
        ("attn.query_proj.weight", P(None, "model")),
        ("blocks.3.attn.key_proj.weight", P(None, "model")),
        ("attn.query_proj.bias", P()),  # `.weight$` does not match a bias
        ("mlp.layers.0.weight", P("model")),
        ("mlp.layers.1.weight", P()),
        ("xattn.query_proj.weight", P()),  # `(^|\.)attn` is a whole part
    ]:
        sharding = shardings(name, leaf)
        assert sharding == NamedSharding(mesh, spec), name
    # One Sharding object per rule, so Orbax sees few distinct shardings.
    assert shardings("a", leaf) is shardings("b", leaf)


def test_restore_with_rules(mesh, saved_block):
    skeleton = eqx.filter_eval_shape(zoo.transformer_block, KEY_SKELETON)
    shardings = oeqx.shardings_from_rules(mesh, RULES)
    restored = oeqx.restore(saved_block, skeleton, shardings=shardings)
    zoo.assert_same(restored, zoo.transformer_block(KEY_SAVE))
    assert _spec(restored.attn.query_proj.weight) == P(None, "model")
    assert _spec(restored.mlp.layers[0].weight) == P("model")
    assert _spec(restored.mlp.layers[0].bias) == P("model")
    assert _spec(restored.mlp.layers[1].weight) == P()
    assert _spec(restored.norm.weight) == P()


def test_rules_accept_compiled_patterns_and_lists(mesh):
    shardings = oeqx.shardings_from_rules(mesh, [[re.compile("weight"), P("data")]])
    assert shardings("w.weight", jax.ShapeDtypeStruct((2,), "float32")).spec == P(
        "data"
    )


def test_unmatched_leaves_are_all_named_before_any_read(mesh, saved_block):
    # Only the sidecar is left: an error about arrays must come before reading.
    for path in saved_block.iterdir():
        if path.name != "orbax_eqx.json":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    skeleton = eqx.filter_eval_shape(zoo.transformer_block, KEY_SKELETON)
    shardings = oeqx.shardings_from_rules(mesh, [(r"weight$", P())])
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(saved_block, skeleton, shardings=shardings)
    message = str(info.value)
    assert message.startswith("Sharding rules cannot place these leaves:\n")
    assert "  - Leaf `norm.bias` matches no sharding rule.\n" in message
    assert "  - Leaf `mlp.layers.0.bias` matches no sharding rule.\n" in message
    assert "  - Leaf `mlp.layers.1.bias` matches no sharding rule.\n" in message
    assert message.count("matches no sharding rule") == 3
    assert message.endswith(
        'end the rules with a catch-all `(r".*", P())` to replicate every other leaf.'
    )


def test_unmatched_leaf_called_directly(mesh):
    shardings = oeqx.shardings_from_rules(mesh, [(r"^embed$", P())])
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"^Leaf `head.weight` matches no sharding rule.\nAdd a rule that "
        r"matches it, or end the rules with a catch-all",
    ):
        shardings("head.weight", jax.ShapeDtypeStruct((4, 4), "float32"))


def test_spec_of_higher_rank_than_leaf(mesh, saved_block):
    skeleton = eqx.filter_eval_shape(zoo.transformer_block, KEY_SKELETON)
    shardings = oeqx.shardings_from_rules(
        mesh, [(r"norm", P("data", None)), (".*", P())]
    )
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"  - Leaf `norm.weight` has shape \(8,\) \(rank 1\), but rule 0 "
        r"\(r'norm', P\('data', None\)\) that matches it has 2 entries.\n"
        r"  - Leaf `norm.bias` has shape \(8,\) .*\nPut an earlier rule for such a "
        r"leaf, with at most one entry per dimension \(e.g. "
        r'`\(r"\^leaf\\\.name\$", P\(\)\)`\), or narrow the pattern so that '
        r"it does not match it.$",
    ):
        oeqx.restore(saved_block, skeleton, shardings=shardings)


def test_scalar_leaf_takes_only_empty_spec(mesh):
    shardings = oeqx.shardings_from_rules(mesh, [(r".*", P("data"))])
    with pytest.raises(
        oeqx.CheckpointMismatchError, match=r"has shape \(\) \(rank 0\)"
    ):
        shardings("step", jax.ShapeDtypeStruct((), "int32"))


@pytest.mark.parametrize(
    "rules, match",
    [
        (
            [(r"w", P("batch"))],
            r"^Rule 0 \(r'w', P\('batch',\)\) names mesh axis 'batch', "
            r"but the mesh has axes \('data', 'model'\).\nUse the mesh's axis names",
        ),
        (
            [(r".*", P()), (r"w", P(("data", "tensor"), "pipe"))],
            r"^Rule 1 .* names mesh axis 'tensor', 'pipe', but the mesh has axes",
        ),
        (
            [(r"w", P("data", ("model", "data")))],
            r"^Rule 0 .* uses mesh axis 'data' for more than one dimension.\nShard "
            r"each mesh axis over at most one dimension",
        ),
        (
            [(r"w(", P())],
            r"^Rule 0: the pattern 'w\(' is not a regular expression: missing \), "
            r"unterminated subpattern at position 1.\nEach rule is a `\(pattern, "
            r"PartitionSpec\)` pair",
        ),
        (
            [(r"w", ("data",))],
            r"^Rule 0 \(r'w'\): the spec is a tuple, not a jax.sharding.PartitionSpec.",
        ),
        ([(r"w", P(), "extra")], r"^Rule 0 is \('w', P\(\), 'extra'\), not a pair."),
        ([(3, P())], r"^Rule 0: the pattern is a int, not a str."),
        (r".*", r"^`rules` is a str, not a list of pairs.\nPass a list of"),
    ],
    ids=[
        "unknown-axis",
        "unknown-axes-in-tuple",
        "repeated-axis",
        "bad-regex",
        "tuple-not-spec",
        "not-a-pair",
        "pattern-not-str",
        "rules-not-list",
    ],
)
def test_bad_rules_fail_when_built(mesh, rules, match):
    with pytest.raises(oeqx.CheckpointMismatchError, match=match):
        oeqx.shardings_from_rules(mesh, rules)


def test_mesh_must_be_a_mesh():
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"^`mesh` is a AbstractMesh, not a jax.sharding.Mesh.\nPass a concrete",
    ):
        oeqx.shardings_from_rules(jax.sharding.AbstractMesh((2,), ("data",)), [])


def test_error_is_a_value_error(mesh):
    with pytest.raises(ValueError):
        oeqx.shardings_from_rules(mesh, [(r"w", P("nope"))])
