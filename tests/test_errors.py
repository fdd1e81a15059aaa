"""Every user-facing error: leaf path, expected vs found, where, and the fix."""

import json
import shutil
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx

KEY = jax.random.key(0)


@pytest.fixture
def saved_mlp(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, zoo.mlp(KEY))
    return path


def test_shape_mismatch_names_leaf_and_suggests_inspect(saved_mlp):
    skel = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 16, 2, key=KEY)
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(saved_mlp, skel)
    msg = str(info.value)
    assert f"does not match the checkpoint at {saved_mlp}" in msg
    assert (
        "Leaf `layers.0.weight` has shape (16, 3) in the skeleton but (8, 3) in "
        "the checkpoint." in msg
    )
    assert "python -m orbax_eqx inspect" in msg


def test_dtype_mismatch_suggests_cast(saved_mlp):
    skel = eqx.filter_eval_shape(zoo.mlp, KEY)
    skel = eqx.tree_at(
        lambda m: m.layers[0].bias, skel, jax.ShapeDtypeStruct((8,), jnp.float16)
    )
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `layers\.0\.bias` has dtype float16 in the skeleton but "
        r"float32 in the checkpoint.*cast=True",
    ):
        oeqx.restore(saved_mlp, skel)


def test_prng_key_dtypes_are_never_cast(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"k": jax.random.key(0)})
    skel = {"k": jax.ShapeDtypeStruct((2,), jnp.uint32)}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `k` has shape \(2,\) in the skeleton but \(\) in",
    ):
        oeqx.restore(tmp_path / "ckpt", skel, cast=True)
    skel = {"k": jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"has dtype key<rbg> in the skeleton but key<fry> in the checkpoint",
    ):
        oeqx.restore(tmp_path / "ckpt", skel, cast=True)


def test_missing_and_unexpected_leaves(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"a": jnp.ones(2), "b": jnp.ones(2)})
    skel = {"a": jax.ShapeDtypeStruct((2,), jnp.float32), "c": 1}
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", skel)
    msg = str(info.value)
    assert "(2 differences)" in msg
    assert "Leaf `c` is in the skeleton but not in the checkpoint." in msg
    assert "Leaf `b` is in the checkpoint but not in the" in msg
    assert "strict=False" in msg


def test_static_field_mismatch_is_an_error_by_default(tmp_path):
    oeqx.save(tmp_path / "ckpt", zoo.Block(KEY, num_heads=2))
    skel = eqx.filter_eval_shape(zoo.Block, KEY, num_heads=4)
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", skel)
    msg = str(info.value)
    assert (
        "Static field `num_heads` of module `<root>` is 4 in the skeleton but 2 in "
        "the checkpoint." in msg
    )
    assert "Static field `num_heads` of module `attn` is 4" in msg
    assert 'on_static_mismatch="warn"' in msg


def test_static_mismatch_can_be_downgraded_to_a_warning(tmp_path):
    saved = zoo.Block(KEY, num_heads=2)
    oeqx.save(tmp_path / "ckpt", saved)
    skel = eqx.filter_eval_shape(zoo.Block, jax.random.key(3), num_heads=4)
    with pytest.warns(oeqx.StaticMismatchWarning, match="restoring anyway"):
        restored = oeqx.restore(tmp_path / "ckpt", skel, on_static_mismatch="warn")
    assert restored.num_heads == 4  # the skeleton's static fields are kept
    np.testing.assert_array_equal(restored.norm.weight, saved.norm.weight)


def test_callable_mismatch(saved_mlp):
    skel = eqx.filter_eval_shape(
        eqx.nn.MLP, 3, 2, 8, 2, activation=jax.nn.tanh, key=KEY
    )
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `activation` is callable .*tanh in the skeleton but .*relu in "
        r"the checkpoint",
    ):
        oeqx.restore(saved_mlp, skel)


def test_module_class_mismatch(tmp_path):
    oeqx.save(tmp_path / "ckpt", eqx.nn.Linear(2, 2, key=KEY))

    class MyLinear(eqx.nn.Linear):
        pass

    skel = eqx.filter_eval_shape(MyLinear, 2, 2, key=KEY)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Module `<root>` is `.*MyLinear` in the skeleton but "
        r"`equinox.nn._linear.Linear` in the checkpoint",
    ):
        oeqx.restore(tmp_path / "ckpt", skel)


def test_kind_mismatch(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"step": 3, "w": jnp.ones(2), "f": 1.0})
    skel = {"step": jax.ShapeDtypeStruct((), jnp.int32), "w": None, "f": 1}
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", skel)
    msg = str(info.value)
    assert (
        "Leaf `step` is array int32[] in the skeleton but int 3 in the checkpoint"
        in msg
    )
    assert "Leaf `w` is None in the skeleton but array float32[2]" in msg
    assert "Leaf `f` is a Python int in the skeleton but a Python float" in msg


def test_filtered_skeleton_without_arrays_is_an_error(saved_mlp):
    model = zoo.mlp(KEY)
    _, static = eqx.partition(model, eqx.is_array)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `layers\.0\.weight` is None in the skeleton but array",
    ):
        oeqx.restore(saved_mlp, static)


def test_long_lists_are_capped(tmp_path):
    oeqx.save(tmp_path / "ckpt", {f"w{i:02d}": jnp.ones(2) for i in range(30)})
    skel = {f"w{i:02d}": jax.ShapeDtypeStruct((3,), jnp.float32) for i in range(30)}
    with pytest.raises(
        oeqx.CheckpointMismatchError, match=r"\(30 differences\)(?s:.*)and 10 more\."
    ):
        oeqx.restore(tmp_path / "ckpt", skel)


def test_mismatch_is_reported_before_any_array_is_read(saved_mlp):
    # Without the array data a read would fail; the check must fail first.
    for p in saved_mlp.iterdir():
        if p.name != "orbax_eqx.json":
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    skel = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 16, 2, key=KEY)
    with pytest.raises(oeqx.CheckpointMismatchError, match="has shape"):
        oeqx.restore(saved_mlp, skel)


def test_saving_a_skeleton_is_refused(tmp_path):
    skel = eqx.filter_eval_shape(zoo.mlp, KEY)
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=r"(?s)Leaf `layers\.0\.weight` is a jax.ShapeDtypeStruct, which holds "
        r"no data to save.*Save a model with concrete arrays",
    ):
        oeqx.save(tmp_path / "ckpt", skel)
    assert not (tmp_path / "ckpt").exists()


def test_saving_over_an_existing_checkpoint_is_refused(saved_mlp):
    with pytest.raises(FileExistsError, match=r"already exists. Pass `overwrite=True`"):
        oeqx.save(saved_mlp, {"w": jnp.ones(1)})
    assert "layers.0.weight" in oeqx.metadata(saved_mlp).leaves


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_saving_onto_a_plain_file_never_offers_overwrite(tmp_path, overwrite):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    verb = "replace" if overwrite else "save to"
    with pytest.raises(
        FileExistsError,
        match=rf"^Cannot {verb} \S+/notes\.txt: it is a file, not an orbax_eqx "
        r"checkpoint, and .*nothing was changed\. Choose another directory, or "
        r"move or delete it yourself if it is not needed\.$",
    ) as info:
        oeqx.save(target, {"w": jnp.ones(1)}, overwrite=overwrite)
    assert "Pass `overwrite=True`" not in str(info.value)
    assert target.read_text() == "mine"


def test_bad_static_policy():
    with pytest.raises(ValueError, match=r'expected "error" or "warn"'):
        oeqx.EqxRestore(None, on_static_mismatch="ignore")


def test_shardings_tree_of_wrong_structure(saved_mlp):
    skel = eqx.filter_eval_shape(zoo.mlp, KEY)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"`shardings=` is a PyTree that does not match the skeleton",
    ):
        oeqx.restore(saved_mlp, skel, shardings=[device, device])


def test_shardings_function_returning_junk(saved_mlp):
    skel = eqx.filter_eval_shape(zoo.mlp, KEY)
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `layers\.0\.weight`: the `shardings=` function returned str, "
        r"not a jax.sharding.Sharding",
    ):
        oeqx.restore(saved_mlp, skel, shardings=lambda name, leaf: "cpu")


# --- paths and sidecars -------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(oeqx.CheckpointNotFoundError, match=r"nope does not exist\."):
        oeqx.restore(tmp_path / "nope")


def test_directory_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        oeqx.CheckpointNotFoundError, match=r"holds no orbax_eqx checkpoint"
    ):
        oeqx.metadata(tmp_path / "empty")


def test_manager_root_is_not_a_checkpoint(tmp_path):
    oeqx.save(tmp_path / "root" / "3" / "default", {"w": jnp.ones(1)})
    oeqx.save(tmp_path / "root" / "5" / "default", {"w": jnp.ones(1)})
    with pytest.raises(
        oeqx.CheckpointNotFoundError,
        match=r"is a CheckpointManager root \(steps 3, 5\), not a checkpoint; pass a "
        r"step directory such as .*root/5",
    ):
        oeqx.restore(tmp_path / "root")


def _write_sidecar(path, text):
    (path / "orbax_eqx.json").write_bytes(sidecars.seal_text(text))


# What every sidecar has besides its leaves and packs.
_HEAD = (
    '"format": "orbax_eqx", "format_version": 7, "versions": {}, '
    '"token": "0123456789abcdef", "modules": {}'
)
_PACK = '{"file": "orbax_eqx~packed.0123456789abcdef.0.bin", "nbytes": 16, '
_PACK += '"byteorder": "little"}'
_ARRAY = '"kind": "array", "shape": [4], "dtype": "float32", "container": "jax"'


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"format": "orbax_eqx", "format_', r"is not JSON as orbax_eqx writes it"),
        ("[1, 2]", r"is not JSON as orbax_eqx writes it \(Expected `object`"),
        (
            '{"format": "orbax_eqx", "format_version": 99, "leaves": {}}',
            r"is of format version 99; this orbax_eqx reads format version 7 "
            r"only\. Upgrade orbax_eqx",
        ),
        (
            '{"format": "orbax_eqx", "format_version": 6, "leaves": {}}',
            r"is of format version 6; this orbax_eqx reads format version 7 only\. "
            r"It was written by an earlier, unreleased orbax_eqx",
        ),
        (
            "{" + _HEAD + ', "leaves": {"w": {"kind": "pickle"}}}',
            r"leaf 'w' is malformed \(Invalid value 'pickle' - at `\$\.kind`\)",
        ),
        (
            "{" + _HEAD + ', "leaves": {"w": {"kind": "array", "shape": [-1], '
            '"dtype": "float32"}}}',
            r"leaf 'w' is malformed \(Expected `int` >= 0 - at `\$\.shape\[0\]`\)",
        ),
        (
            "{" + _HEAD + ', "leaves": {"w": {' + _ARRAY + ', "nbytes": 4, '
            '"data": "orbax", "key": "../../etc/passwd", "sum32": null}}}',
            r"leaf 'w' has storage key '../../etc/passwd', expected 'w'",
        ),
        (
            "{" + _HEAD + ', "leaves": {}, "packs": [{"file": "../../etc/passwd", '
            '"nbytes": 8, "byteorder": "little"}]}',
            r"pack 0 is in file '../../etc/passwd', not a pack file",
        ),
        (
            "{" + _HEAD + ', "leaves": {"w": {' + _ARRAY + ', "data": "packed", '
            '"pack": 1, "offset": 0, "nbytes": 16}}, "packs": [' + _PACK + "]}",
            r"leaf 'w' is in pack 1, which is not listed",
        ),
        (
            "{" + _HEAD + ', "leaves": {"w": {' + _ARRAY + ', "data": "packed", '
            '"pack": 0, "offset": 64, "nbytes": 16}}, "packs": [' + _PACK + "]}",
            r"leaf 'w' ends at byte 80 of pack 0, which holds 16",
        ),
        (
            "{" + _HEAD + ', "leaves": {"w": {' + _ARRAY + ', "data": "packed", '
            '"pack": 0, "offset": 0, "nbytes": 8}}, "packs": [' + _PACK + "]}",
            r"leaf 'w' has 8 bytes in its pack, but a float32 array of shape "
            r"\(4,\) has 16",
        ),
    ],
    ids=[
        "truncated",
        "wrong_shape",
        "newer",
        "older",
        "unknown_kind",
        "bad_shape",
        "escaping_key",
        "escaping_pack_file",
        "unlisted_pack",
        "beyond_pack",
        "wrong_packed_size",
    ],
)
def test_damaged_sidecar(saved_mlp, text, match):
    _write_sidecar(saved_mlp, text)
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(saved_mlp)


def test_missing_sidecar(saved_mlp):
    (saved_mlp / "orbax_eqx.json").unlink()
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"orbax_eqx.json is missing"):
        oeqx.EqxHandler().restore(saved_mlp)


def test_an_empty_sidecar_is_damage(saved_mlp):
    (saved_mlp / "orbax_eqx.json").write_bytes(b"")
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=r"is not JSON as orbax_eqx writes"
    ):
        oeqx.restore(saved_mlp)


def test_reading_a_sidecar_imports_and_runs_nothing(tmp_path):
    sidecar = {
        "format": "orbax_eqx",
        "format_version": 7,
        "versions": {},
        "token": "0123456789abcdef",
        "leaves": {
            "f": {"kind": "callable", "value": {"callable": "evil_mod_xyz.run"}},
            "o": {"kind": "object", "value": {"object": "os.system", "repr": "rm"}},
            "s": {"kind": "scalar", "value": {"float": "1.5"}},
        },
        "modules": {"": {"class": "evil_mod_xyz.Module", "static": {}}},
    }
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "orbax_eqx.json").write_bytes(
        sidecars.seal_text(json.dumps(sidecar))
    )
    flat = oeqx.restore(tmp_path / "ckpt")
    assert "evil_mod_xyz" not in sys.modules
    assert flat["f"] == oeqx.RecordedLeaf("callable", "evil_mod_xyz.run")
    assert flat["o"] == oeqx.RecordedLeaf("object", "rm")
    assert flat["s"] == 1.5
