"""Hostile leaf records: where a sidecar says a leaf's bytes are.

A record that disagrees with Orbax's array store (shape, dtype, a leaf it
lacks or one it holds unlisted), an enormous shape in the sidecar or in Orbax's
own metadata, names that try to escape the checkpoint's directory (leaf
names, alias targets, module names): each fails with a clear error, or is only
a dict key, and touches nothing; nothing is allocated before the sizes are
checked against the files.

Sidecars are edited with their checksum recomputed (`tests/sidecars.py`),
an attacker's leaf name stored under the key the format derives from it.
"""

import asyncio
import json
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import tensorstore as ts
import zoo
from children import restore_in_child
from untouched import fails_touching_nothing, snapshot

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(1)
KEY_SKELETON = jax.random.key(2)
PACK = re.compile(r"orbax_eqx~packed\.[0-9a-f]{16}\.0\.bin")  # the one pack file
HUGE = 2**40


def _pack(path):
    """The pack file of the checkpoint at `path` (its name holds the save's token)."""
    return path / oeqx.metadata(path).packs[0].file


def _unpacked(tmp_path, **options):
    """A checkpoint whose arrays are all in Orbax's array store."""
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    oeqx.save(path, item, pack=False, **options)
    return path, item


def _store(path):
    """The directory of the checkpoint's Orbax array store."""
    return path / f"orbax_eqx~arrays.{oeqx.metadata(path).token}"


def _ocdbt_write(path, key: str, edit) -> None:
    """Edits the JSON value at `key` in an OCDBT store, as a tamperer could."""

    async def run():
        base = f"file://{_store(path)}/"
        store = await ts.KvStore.open({"driver": "ocdbt", "base": base})
        value = json.loads((await store.read(key)).value)
        edit(value)
        await store.write(key, json.dumps(value).encode())

    asyncio.run(run())


# --- the sidecar and Orbax's array metadata disagree ---------------------------


def _set(name, field, value):
    def edit(content):
        content["leaves"][name][field] = value

    return edit


def _add_stored_leaf(content):
    record = dict(content["leaves"]["a"], path="['c']", key="c")
    content["leaves"]["c"] = record


def _drop_leaf(content):
    del content["leaves"]["b"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _set("a", "shape", [500]),
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[500\] in the sidecar but "
            r"<f4\[1000\] in Orbax's array store",
        ),
        (
            _set("a", "dtype", "int32"),
            r"Leaf `\['a'\]` \(leaf name `a`\) is int32\[1000\] in the sidecar but "
            r"<f4\[1000\] in Orbax's array store",
        ),
        (
            _add_stored_leaf,
            r"Leaf `\['c'\]` \(leaf name `c`\) is stored in Orbax's array store, says "
            r"the sidecar, but the store holds no array under key `c`",
        ),
        (
            _drop_leaf,
            r"Orbax's array store holds an array under key `b`, which the sidecar does "
            r"not list",
        ),
    ],
    ids=["shape", "dtype", "leaf_missing_from_store", "store_has_unlisted_array"],
)
def test_sidecar_disagrees_with_orbax_store(tmp_path, edit, match):
    path, _ = _unpacked(tmp_path)
    sidecars.edit(path, edit)
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"(?s)The checkpoint at .*ckpt\S* is damaged: its sidecar and Orbax's array "
        rf"store disagree \(1 difference\):\n  - {match}.*do not belong together.*"
        r"Restore an earlier step, or re-save the checkpoint\.",
    )


def test_only_the_leaves_being_read_are_compared(tmp_path):
    path, item = _unpacked(tmp_path)
    sidecars.edit(path, _set("a", "shape", [500]))
    skeleton = {"b": jax.ShapeDtypeStruct((4, 4), jnp.int32)}
    restored = oeqx.restore(path, skeleton, strict=False)
    np.testing.assert_array_equal(restored["b"], item["b"])


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "no_ocdbt"])
def test_leaves_named_like_orbax_files_pass_the_comparison(tmp_path, use_ocdbt):
    # Whether a store is OCDBT is decided as Orbax does, not by a file name
    # that a leaf name could also give.
    item = {n: jnp.arange(3.0) for n in ("d", "ocdbt.process_0", "manifest.ocdbt")}
    oeqx.save(tmp_path / "ckpt", item, pack=False, use_ocdbt=use_ocdbt)
    skeleton = eqx.filter_eval_shape(lambda: item)
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), item)


@pytest.mark.slow
def test_orbax_metadata_comparison_passes_for_the_dtypes_entry_with_zarr3(tmp_path):
    item = zoo.dtypes(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item, pack=False, use_zarr3=True)
    restored = oeqx.restore(tmp_path / "ckpt", zoo.skeleton(zoo.dtypes, KEY_SKELETON))
    zoo.assert_same(restored, item)


# --- enormous shapes -----------------------------------------------------------


def _huge_packed(content, shape=(HUGE,)):
    record = content["leaves"]["a"]
    size = int(np.prod(shape, dtype=object)) * 4
    record["shape"], record["nbytes"] = list(shape), size
    content["packs"][0]["nbytes"] = record["offset"] + size + 4096


def _packed(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)})
    return path


def test_enormous_sidecar_shape_fails_the_skeleton_check(tmp_path):
    path = _packed(tmp_path)
    sidecars.edit(path, _huge_packed)
    skeleton = {
        "a": jax.ShapeDtypeStruct((1000,), jnp.float32),
        "b": jax.ShapeDtypeStruct((4, 4), jnp.int32),
    }
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointMismatchError,
        r"Leaf `a` has shape \(1000,\) in the skeleton but \(1099511627776,\) "
        "in the checkpoint",
        skeleton,
    )


@pytest.mark.parametrize(
    "shape",
    [(HUGE,), (2**62, 2**62)],
    ids=["terabytes", "overflowing_int64"],
)
@pytest.mark.slow
def test_enormous_packed_leaf_is_refused_before_allocating(tmp_path, shape):
    path = _packed(tmp_path)
    sidecars.edit(path, lambda c: _huge_packed(c, shape))
    size = os.path.getsize(_pack(path))
    # A fresh interpreter: were the buffer allocated first, this must not abort
    # pytest. It needs no memory at all: the file is checked first.
    result = restore_in_child(path)
    assert result["type"] == "CheckpointDamagedError"
    assert re.search(
        rf"The pack file .*{PACK.pattern} has {size} bytes where \d+ were written: "
        "the checkpoint is damaged",
        result["message"],
    )


def test_enormous_sidecar_shape_of_orbax_leaf_is_refused(tmp_path):
    path, _ = _unpacked(tmp_path)
    sidecars.edit(path, _set("a", "shape", [HUGE]))
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1099511627776\] in the "
        r"sidecar but <f4\[1000\] in Orbax's array store",
    )


@pytest.mark.parametrize(
    "field, match",
    [
        (
            "shape",
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1000\] in the sidecar but "
            r"<f4\[1099511627776\] in Orbax's array store",
        ),
        (
            "chunks",
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1000\] but its chunks in "
            r"Orbax's array store are \[1099511627776\] .*larger than the array",
        ),
    ],
    ids=["orbax_shape", "orbax_chunks"],
)
@pytest.mark.slow
def test_enormous_orbax_metadata_is_refused_before_reading(tmp_path, field, match):
    path, _ = _unpacked(tmp_path)
    _ocdbt_write(path, "a/.zarray", lambda z: z.__setitem__(field, [HUGE]))
    before = snapshot(tmp_path)
    result = restore_in_child(path)
    assert snapshot(tmp_path) == before
    assert result["type"] == "CheckpointDamagedError"
    assert re.search(match, result["message"]), result["message"]


# --- names that try to escape the directory ------------------------------------


def _rename_leaf(old, new, key):
    def edit(content):
        leaves = content["leaves"]
        record = leaves.pop(old)
        if record.get("data") == "orbax":
            record["key"] = key
        leaves[new] = record

    return edit


def _sentinel(tmp_path):
    """A file where an escaping name would point, to see it is never touched."""
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"do not touch")
    return sentinel


@pytest.mark.parametrize(
    "escape",
    ["../sentinel", "../../sentinel", "/{tmp}/sentinel", "a/../../sentinel"],
    ids=["up", "up_twice", "absolute", "down_and_up"],
)
@pytest.mark.parametrize(
    "layout", ["packed", "orbax", "orbax_no_ocdbt"], ids=["packed", "orbax", "files"]
)
def test_escaping_leaf_names_stay_inside(tmp_path, layout, escape):
    name = escape.format(tmp=str(tmp_path).strip("/"))
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    options = {"packed": {}, "orbax": {"pack": False}}.get(
        layout, {"pack": False, "use_ocdbt": False}
    )
    oeqx.save(path, item, **options)
    key = sidecars.storage_key(name)
    sidecars.edit(path, _rename_leaf("a", name, key))
    sentinel = _sentinel(tmp_path)
    before = snapshot(tmp_path)
    if layout == "packed":
        # A name is a dict key: the bytes come from the pack file, as recorded
        # (resealed, the edit is the writer's word), never from a path.
        restored = oeqx.restore(path)
        np.testing.assert_array_equal(restored[name], np.arange(1000.0))
    else:
        # The storage key is derived from the name, one path component: no array
        # is stored under it.
        with pytest.raises(
            oeqx.CheckpointDamagedError,
            match=rf"Leaf `\['a'\]` \(leaf name `{re.escape(name)}`\) is stored in "
            rf"Orbax's array store, says the sidecar, but the store holds no array "
            rf"under key `{re.escape(key)}`",
        ):
            oeqx.restore(path)
        assert "/" not in key and key != ".."
    assert snapshot(tmp_path) == before
    assert sentinel.read_bytes() == b"do not touch"


@pytest.mark.parametrize(
    "target", ["nope", "../sentinel", "/etc/passwd"], ids=["missing", "up", "absolute"]
)
def test_alias_of_a_name_that_is_no_leaf(tmp_path, target):
    path = tmp_path / "ckpt"
    oeqx.save(path, _tied())
    sidecars.edit(path, lambda c: _retarget_alias(c, target))
    _sentinel(tmp_path)
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"The sidecar in .*ckpt is damaged: leaf '.*' is an alias of "
        rf"{re.escape(repr(target))}, which is no stored array of the same shape and "
        "dtype. Restore an earlier step",
    )


def _tied():
    w = jnp.ones((3, 3))
    return {"x": w, "y": w}


def _retarget_alias(content, target):
    aliases = [r for r in content["leaves"].values() if r.get("data") == "alias"]
    assert aliases
    aliases[0]["alias_of"] = target


@pytest.mark.parametrize(
    "module", ["../../sentinel", "/etc", "layers/../../x"], ids=["up", "abs", "mixed"]
)
def test_escaping_module_names_are_only_dict_keys(tmp_path, module):
    path = tmp_path / "ckpt"
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(path, model)
    sidecars.edit(path, lambda c: c["modules"].__setitem__(module, c["modules"][""]))
    sentinel = _sentinel(tmp_path)
    before = snapshot(tmp_path)
    flat = oeqx.restore(path)
    np.testing.assert_array_equal(flat["layers.0.weight"], model.layers[0].weight)
    assert module in oeqx.metadata(path).modules
    restored = oeqx.restore(path, eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON))
    zoo.assert_same(restored, model)
    assert snapshot(tmp_path) == before
    assert sentinel.read_bytes() == b"do not touch"
