"""Restore what you need: subtrees, `prefix=`, `missing="keep"`, `renames=`."""

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)


@pytest.fixture
def saved_train_state(tmp_path):
    """A checkpoint of `{"model": m, "opt_state": s, "step": 3}`, and the item."""
    item = zoo.optax_state(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item)
    return tmp_path / "ckpt", item


# ---------------------------------------------------------------- subtrees


@pytest.mark.parametrize("part", ["model", "opt_state", "step"])
def test_subtree_restores_only_that_part(saved_train_state, part):
    path, item = saved_train_state
    skeleton = {part: zoo.skeleton(zoo.optax_state, KEY_SKELETON)[part]}
    if part == "step":
        skeleton = {"step": 0}  # a Python leaf comes from the checkpoint too
    restored, report = oeqx.restore(path, skeleton, strict=False, report=True)
    zoo.assert_same(restored, {part: item[part]})
    assert report.kept == ()
    assert report.unread and all(not n.startswith(part) for n in report.unread)
    everything = set(oeqx.metadata(path).leaves)
    assert {n for n in everything if n.startswith(part)} == everything - set(
        report.unread
    )


def test_strict_lists_unrequested_leaves_and_names_the_options(saved_train_state):
    path, _ = saved_train_state
    skeleton = {"model": zoo.skeleton(zoo.mlp, KEY_SKELETON)}
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(path, skeleton)
    msg = str(info.value)
    assert re.search(r"\(\d+ differences\)", msg)
    assert (
        "Leaf `opt_state.1.0.mu.layers.0.weight` is in the checkpoint but not in "
        "the skeleton." in msg
    )
    assert "Leaf `step` is in the checkpoint" in msg
    assert "`EqxRestore(..., strict=False)`" in msg
    assert '`prefix="model.encoder"`' in msg


def _io_rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux only")
def test_a_subtree_reads_only_its_arrays(tmp_path):
    # Random data, so that compression leaves the sizes about as they are.
    rng = np.random.default_rng(0)
    item = {f"l{i}": rng.standard_normal(2**18, np.float32) for i in range(10)}
    oeqx.save(tmp_path / "ckpt", item)
    leaf = jax.ShapeDtypeStruct((2**18,), jnp.float32)
    oeqx.restore(tmp_path / "ckpt", {"l0": leaf}, strict=False)  # warm up
    total = 10 * 2**20

    def bytes_read(skeleton) -> int:
        before = _io_rchar()
        oeqx.restore(tmp_path / "ckpt", skeleton, strict=False)
        return _io_rchar() - before

    one = bytes_read({"l3": leaf})
    everything = bytes_read(dict.fromkeys(item, leaf))
    assert everything > 0.85 * total
    assert one < 0.2 * total, (one, everything)


# ------------------------------------------------------------------ prefix


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_prefix_restores_one_part_into_its_own_skeleton(tmp_path, make):
    part = make(KEY_SAVE)
    item = {"model": {"encoder": part, "decoder": zoo.mlp(KEY_SAVE)}, "step": 3}
    oeqx.save(tmp_path / "ckpt", item)
    # strict=True: every leaf under the prefix must be in the skeleton, and
    # those outside it are no concern.
    restored, report = oeqx.restore(
        tmp_path / "ckpt",
        zoo.skeleton(make, KEY_SKELETON),
        prefix="model.encoder",
        report=True,
    )
    zoo.assert_same(restored, part)
    assert "step" in report.unread
    assert not any(n.startswith("model.encoder") for n in report.unread)


@pytest.mark.parametrize(
    "prefix, pick",
    [
        ("blocks.1", lambda item: item["blocks"][1]),
        (r"odd\.key.\7", lambda item: item["odd.key"]["7"]),
        ("blocks.0.layers.2.weight", lambda item: item["blocks"][0].layers[2].weight),
    ],
    ids=["list-index", "escaped-dict-keys", "one-leaf"],
)
def test_prefix_is_a_leaf_name(tmp_path, prefix, pick):
    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "blocks": [zoo.mlp(k1), zoo.mlp(k2)],
            "odd.key": {"7": zoo.transformer_block(k3)},
        }

    item = make(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = pick(eqx.filter_eval_shape(make, KEY_SKELETON))
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, prefix=prefix)
    zoo.assert_same(restored, pick(item))


def test_prefix_with_strict_reports_leaves_under_the_prefix_only(tmp_path):
    item = {"model": {"encoder": zoo.mlp(KEY_SAVE), "head": zoo.mlp(KEY_SAVE)}}
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 8, 1, key=KEY_SKELETON)
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton, prefix="model.encoder")
    msg = str(info.value)
    assert (
        "Leaf `layers.1.weight` (checkpoint leaf `model.encoder.layers.1.weight`) "
        "has shape (2, 8) in the skeleton but (8, 8) in the checkpoint." in msg
    )
    assert (
        "Leaf `model.encoder.layers.2.weight` is in the checkpoint but not in the "
        "skeleton." in msg
    )
    assert "model.head" not in msg
    assert "strict=False" in msg


def test_prefix_that_matches_nothing_suggests_close_names(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"model": {"encoder": zoo.mlp(KEY_SAVE)}})
    skeleton = zoo.skeleton(zoo.mlp, KEY_SKELETON)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"No leaf of the checkpoint at .* is under `prefix=\"model\.encodr\"`\. "
        r"Did you mean `model\.encoder`\? A prefix is a leaf name",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, prefix="model.encodr")
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"under `prefix=\"zzz\"`\. Its leaf names start with `model`\.",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, prefix="zzz")


@pytest.mark.parametrize("make", [zoo.mlp, zoo.batchnorm_state], ids=["mlp", "state"])
def test_a_part_without_prefix_suggests_the_prefix(tmp_path, make):
    oeqx.save(tmp_path / "ckpt", {"model": {"encoder": make(KEY_SAVE)}, "step": 1})
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"The skeleton matches the checkpoint's leaves under a prefix: pass "
        r"`EqxRestore\(\.\.\., prefix=\"model\.encoder\"\)`\.",
    ) as info:
        oeqx.restore(tmp_path / "ckpt", zoo.skeleton(make, KEY_SKELETON))
    assert "missing=" not in str(info.value)  # the skeleton is not at fault


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"prefix": 3}, TypeError, r"EqxRestore\(prefix=3\): expected a leaf name"),
        (
            {"prefix": "model."},
            ValueError,
            r"without a leading or trailing `\.`",
        ),
        ({"missing": "skip"}, ValueError, r'missing=\'skip\'\): expected "error" or'),
    ],
    ids=["prefix-type", "prefix-dot", "missing-value"],
)
def test_option_values_are_checked_when_made(options, error, match):
    with pytest.raises(error, match=match):
        oeqx.EqxRestore(zoo.skeleton(zoo.mlp, KEY_SKELETON), **options)


def test_options_that_need_a_skeleton(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"EqxRestore\(prefix='model', report=True\) needs a skeleton",
    ):
        oeqx.EqxRestore(prefix="model", report=True)


# ------------------------------------------------------ lenient fine-tuning


class Classifier(eqx.Module):
    body: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, classes, key):
        k1, k2 = jax.random.split(key)
        self.body = eqx.nn.MLP(4, 8, 8, 1, key=k1)
        self.head = eqx.nn.Linear(8, classes, key=k2)


@pytest.mark.slow
def test_missing_keep_keeps_a_new_head_from_the_skeleton(tmp_path):
    pretrained = Classifier(10, KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", pretrained)
    fresh = Classifier(3, KEY_SKELETON)  # a new task: 3 classes, a new head
    drop = {"head.weight": None, "head.bias": None}  # the old head is not wanted
    restored, report = oeqx.restore(
        tmp_path / "ckpt", fresh, renames=drop, missing="keep", report=True
    )
    zoo.assert_same(restored.body, pretrained.body)
    assert restored.head.weight is fresh.head.weight  # kept, not copied
    assert restored.head.bias is fresh.head.bias
    assert report.kept == ("head.weight", "head.bias")
    assert report.unread == ("head.weight", "head.bias")
    assert report.renamed == drop


def test_missing_keep_warns_with_the_kept_leaves_unless_reported(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"body": zoo.mlp(KEY_SAVE)})
    skeleton = {
        "body": zoo.skeleton(zoo.mlp, KEY_SKELETON),
        "head": eqx.nn.Linear(2, 5, key=KEY_SKELETON),
        "temperature": 0.5,
    }
    with pytest.warns(
        oeqx.OrbaxEqxWarning,
        match=r"(?s)3 skeleton leaves are not in the checkpoint at .* so kept "
        r"from the skeleton \(missing=\"keep\"\):\n  - `head\.weight`\n"
        r"  - `head\.bias`\n  - `temperature`\nPass `report=True`",
    ):
        restored = oeqx.restore(tmp_path / "ckpt", skeleton, missing="keep")
    assert restored["temperature"] == 0.5
    assert restored["head"] is not None
    zoo.assert_same(restored["body"], zoo.mlp(KEY_SAVE))


def test_missing_keep_cannot_fill_shape_dtype_structs(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"body": zoo.mlp(KEY_SAVE)})
    skeleton = {
        "body": zoo.skeleton(zoo.mlp, KEY_SKELETON),
        "head": eqx.filter_eval_shape(eqx.nn.Linear, 2, 5, key=KEY_SKELETON),
    }
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `head\.weight` is in the skeleton but not in the "
        r"checkpoint, and is a jax.ShapeDtypeStruct: it has no value to keep with "
        r"`missing=\"keep\"`\..*build those parts of the skeleton as concrete arrays",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, missing="keep")


def test_missing_leaves_error_names_missing_keep(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"body": zoo.mlp(KEY_SAVE)})
    skeleton = {
        "body": zoo.skeleton(zoo.mlp, KEY_SKELETON),
        "head": eqx.nn.Linear(2, 5, key=KEY_SKELETON),
    }
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `head\.weight` is in the skeleton but not in the "
        r"checkpoint\..*`renames=`.*`EqxRestore\(\.\.\., missing=\"keep\"\)`",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)


# ----------------------------------------------------------------- renames


def _blocks(key):
    k1, k2 = jax.random.split(key)
    return {"blocks": [zoo.transformer_block(k1), zoo.transformer_block(k2)]}


def _layers(key):
    return {"layers": _blocks(key)["blocks"]}


M = oeqx.StateDictMapping
# The skeleton's `layers.*` read from the checkpoint's `blocks.*`.
TO_BLOCKS = M().rename_regex(r"layers\.(.*)", r"blocks.\1")


@pytest.mark.parametrize(
    "renames",
    [
        TO_BLOCKS,
        M().rename_regex([(re.compile(r"layers\.(?P<rest>.*)"), r"blocks.\g<rest>")]),
        M().rename("layers", "blocks"),
        {"blocks": "layers"},
    ],
    ids=["rule", "compiled-rule", "rename", "dict"],
)
def test_renames_map_old_names_to_the_skeleton(tmp_path, renames):
    old = _blocks(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", old)
    restored, report = oeqx.restore(
        tmp_path / "ckpt",
        eqx.filter_eval_shape(_layers, KEY_SKELETON),
        renames=renames,
        report=True,
    )
    zoo.assert_same(restored, {"layers": old["blocks"]})
    assert report.renamed["blocks.1.norm.weight"] == "layers.1.norm.weight"


def test_renames_dict_and_prefix_apply_in_that_order(tmp_path):
    item = {"model": {"enc": {"w_old": jnp.arange(3.0), "b": jnp.ones(2)}}}
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = {
        "w": jax.ShapeDtypeStruct((3,), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    restored = oeqx.restore(
        tmp_path / "ckpt",
        skeleton,
        prefix="model.enc",
        renames={"model.enc.w_old": "model.enc.w"},
    )
    zoo.assert_same(restored, {"w": item["model"]["enc"]["w_old"], "b": jnp.ones(2)})


def test_renamed_modules_still_have_their_static_fields_checked(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"blocks": [zoo.Block(KEY_SAVE, num_heads=2)]})
    skeleton = {"layers": [eqx.filter_eval_shape(zoo.Block, KEY_SKELETON, 4)]}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Static field `num_heads` of module `layers\.0` is 4 in the "
        r"skeleton but 2 in the checkpoint\.",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, renames=TO_BLOCKS)


@pytest.mark.parametrize(
    "renames, match",
    [
        (
            M().rename_regex(r"layres\.(.*)", r"blocks.\1"),
            r"The pattern 'layres.*' of rule 0 .* matches no name \(the "
            r"names it sees look like `layers\.0\.attn",
        ),
        (
            {"blocks.9.norm.weight": "layers.9.norm.weight"},
            r"The entry 'layers\.9\.norm\.weight' of rule 0 .* matches no name",
        ),
        (
            M().rename_regex(r"layers\.(.*)", r"blokcs.\1"),
            r"Rule 0 of `renames=` renames the skeleton's leaves "
            r"\(`layers\.0\.attn\.query_proj\.weight` -> "
            r"`blokcs\.0\.attn\.query_proj\.weight` and \d+ more\) only to names the "
            r"checkpoint lacks \(its leaves are named like `blocks\.0",
        ),
        (
            M().rename({"layers": "blocks", "layers.0": "blocks.0"}),
            r"The entry 'layers' of rule 0 .* is shadowed: every name it fits is "
            r"renamed by a longer entry\.",
        ),
        (
            {"blocks": "layers", "blocks.0.typo": None},
            r"The name 'blocks\.0\.typo' of rule 1 .* matches no name \(the names it "
            r"sees look like `blocks\.0",
        ),
    ],
    ids=[
        "rule-matches-nothing",
        "entry-matches-nothing",
        "typo-target",
        "shadowed",
        "left-unread-matches-nothing",
    ],
)
def test_a_rename_that_does_nothing_is_an_error(tmp_path, renames, match):
    oeqx.save(tmp_path / "ckpt", {"blocks": _blocks(KEY_SAVE)["blocks"][:1]})
    skeleton = {"layers": eqx.filter_eval_shape(_layers, KEY_SKELETON)["layers"][:1]}
    with pytest.raises(oeqx.BridgeError, match=match) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton, renames=renames)
    msg = str(info.value)
    assert f"do nothing, or clash, for the checkpoint at {tmp_path / 'ckpt'}:" in msg
    assert "`EqxRestore(..., renames_must_match=False)`" in msg
    assert f"`python -m orbax_eqx inspect {tmp_path / 'ckpt'}`" in msg


def test_renames_must_match_false_allows_renames_that_do_nothing(tmp_path):
    old = _blocks(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", old)
    restored = oeqx.restore(
        tmp_path / "ckpt",
        eqx.filter_eval_shape(_layers, KEY_SKELETON),
        renames=M().rename_regex(
            [(r"layres\.(.*)", r"x.\1"), (r"layers\.(.*)", r"blocks.\1")]
        ),
        renames_must_match=False,
    )
    zoo.assert_same(restored, {"layers": old["blocks"]})


def test_a_missing_leaf_is_paired_with_an_unread_one_of_its_shape(tmp_path):
    """GPT-NeoX in transformers 5 names its head `lm_head.weight` in memory but
    `embed_out.weight` in its files: the error says which to map."""
    oeqx.save(tmp_path / "ckpt", {"embed_out": {"weight": jnp.ones((4, 3))}})
    skeleton = {"lm_head": {"weight": jax.ShapeDtypeStruct((4, 3), jnp.float32)}}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `lm_head\.weight` is in the skeleton but not in the checkpoint; "
        r"did you mean the checkpoint's `embed_out\.weight`, of that shape and dtype, "
        r"which the skeleton lacks\? \(map it with `renames=`\)\.",
    ) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton)
    assert "is in the checkpoint but not in the skeleton" not in str(info.value)


def test_renames_that_make_two_leaves_one_are_an_error(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"a": jnp.ones(2), "b": jnp.zeros(2)})
    with pytest.raises(
        oeqx.BridgeError,
        match=r"(?s)checkpoint leaves would share a name:\n  - Checkpoint leaves `a` "
        r"and `b` both become `b`\.\nRename them to distinct names",
    ):
        oeqx.restore(
            tmp_path / "ckpt",
            {"b": jax.ShapeDtypeStruct((2,), jnp.float32)},
            renames={"a": "b"},
        )


def test_a_swap_is_no_clash(tmp_path):
    item = {"a": jnp.ones(2), "b": jnp.zeros(2)}
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = dict.fromkeys("ab", jax.ShapeDtypeStruct((2,), jnp.float32))
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, renames={"a": "b", "b": "a"})
    zoo.assert_same(restored, {"a": item["b"], "b": item["a"]})


@pytest.mark.parametrize(
    "renames, match",
    [
        ("blocks", r"`renames=` is a str: expected an `oeqx\.StateDictMapping`"),
        ([("a", "b")], r"`renames=` is a list: expected .* `rename_regex`"),
        (lambda n: n, r"`renames=` is a function: expected"),
        ({"a": 3}, r"`renames=` maps 'a' to 3: a rename map maps names"),
        (
            {"a": "c", "b": "c"},
            r"^`renames=` maps both 'a' and 'b' to 'c': a new name is read from one "
            r"old name\. Give each its own new name, or map one to None to leave it "
            r"unread\.$",
        ),
        (M().drop("a"), r"`renames=` has the rule Drop\(.*which a restore does not"),
    ],
    ids=["str", "list", "function", "dict-value", "dict-one-new-name", "drop"],
)
def test_malformed_renames_fail_when_made(renames, match):
    with pytest.raises(oeqx.BridgeError, match=match):
        oeqx.EqxRestore(zoo.skeleton(zoo.mlp, KEY_SKELETON), renames=renames)


def test_rename_to_none_leaves_a_leaf_out_even_when_strict(tmp_path):
    item = {"keep": jnp.arange(2.0), "old": jnp.ones(2)}
    oeqx.save(tmp_path / "ckpt", item)
    skeleton = {"keep": jax.ShapeDtypeStruct((2,), jnp.float32)}
    restored, report = oeqx.restore(
        tmp_path / "ckpt", skeleton, renames={"old": None}, report=True
    )
    zoo.assert_same(restored, {"keep": item["keep"]})
    assert report.renamed == {"old": None}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton, renames=M().ignore("old"))
    zoo.assert_same(restored, {"keep": item["keep"]})


# A refactor that splits a fused projection: the checkpoint's `attn.qkv` read
# into the skeleton's q, k and v, planned as a load of safetensors is.


class OldAttention(eqx.Module):
    qkv: eqx.nn.Linear

    def __init__(self, key):
        self.qkv = eqx.nn.Linear(4, 12, use_bias=False, key=key)


class NewAttention(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear

    def __init__(self, key):
        kq, kk, kv = jax.random.split(key, 3)
        self.q = eqx.nn.Linear(4, 4, use_bias=False, key=kq)
        self.k = eqx.nn.Linear(4, 4, use_bias=False, key=kk)
        self.v = eqx.nn.Linear(4, 4, use_bias=False, key=kv)


class OldNet(eqx.Module):
    blocks: list

    def __init__(self, key):
        keys = jax.random.split(key, 2)
        self.blocks = [
            {"attn": OldAttention(k), "out": eqx.nn.Linear(4, 4, key=k)} for k in keys
        ]


class NewNet(eqx.Module):
    layers: list

    def __init__(self, key):
        keys = jax.random.split(key, 2)
        self.layers = [
            {"attn": NewAttention(k), "out": eqx.nn.Linear(4, 4, key=k)} for k in keys
        ]


FUSED = (
    M()
    .rename("layers", "blocks")
    .fuse(
        [f"blocks.{{i}}.attn.{p}.weight" for p in "qkv"],
        "blocks.{i}.attn.qkv.weight",
        axis=0,
    )
)


def test_a_restore_whose_reader_takes_no_pieces_refuses_splits(tmp_path):
    oeqx.save(tmp_path / "ckpt", OldNet(KEY_SAVE))
    with pytest.raises(oeqx.BridgeError, match=r"`renames=` changes arrays"):
        oeqx.restore(
            tmp_path / "ckpt",
            eqx.filter_eval_shape(NewNet, KEY_SKELETON),
            renames=FUSED,
        )
