"""The pack as an Orbax `TypeHandler`: Orbax's own handlers (PyTree, Standard,
in a CheckpointManager) with `oeqx.type_handler_registry()` store their jax
arrays in orbax_eqx's pack files, restore them exactly, and say clearly what
is wrong when something is."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sidecars
from unblock import raised_by

import orbax_eqx as oeqx

TYPESTR = "orbax_eqx.PackedArray"


def _state(seed: int) -> dict:
    """A training state: jax arrays of several dtypes (a typed PRNG key, a
    zero-size array) and leaves that Orbax's other handlers keep."""
    k = jax.random.split(jax.random.key(seed), 5)
    return {
        "params": {
            "w": jax.random.normal(k[0], (32, 16)),
            "b": jax.random.normal(k[1], (16,)).astype(jnp.bfloat16),
            "ids": jax.random.randint(k[2], (40,), 0, 2**30),
            "mask": jax.random.bernoulli(k[3], 0.5, (33,)),
        },
        "rng": k[4],
        "empty": jnp.zeros((0, 4)),
        "step": seed,
        "stats": np.arange(5.0) * seed,
    }


def _abstract(tree):
    """Shapes, dtypes and shardings of `tree`'s jax arrays; other leaves kept."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


def _assert_bitwise(got, want):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert type(g) is type(w), (type(g), type(w))
        if isinstance(w, jax.Array):
            assert (g.dtype, g.shape) == (w.dtype, w.shape)
            if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
                g, w = jax.random.key_data(g), jax.random.key_data(w)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), strict=True)
        elif isinstance(w, np.ndarray):
            np.testing.assert_array_equal(g, w, strict=True)
        else:
            assert g == w


def _pytree_handler(**kwargs):
    return ocp.PyTreeCheckpointHandler(
        type_handler_registry=oeqx.type_handler_registry(**kwargs)
    )


def _group(item_dir: Path) -> Path:
    (group,) = item_dir.glob("orbax_eqx~typed.*")
    return group


def _index(item_dir: Path) -> dict:
    """The group's sidecar, every record whole (`tests/sidecars.py`)."""
    return sidecars.read(_group(item_dir))


def _save_pytree(path: Path, tree) -> Path:
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    return path


def _restore_pytree(path: Path, target, handler=None, **kwargs):
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    with ocp.Checkpointer(handler or _pytree_handler()) as ckptr:
        return ckptr.restore(
            path,
            args=ocp.args.PyTreeRestore(target, restore_args=restore_args, **kwargs),
        )


def test_pytree_handler_in_a_manager_round_trips_bitwise(tmp_path):
    saved = _state(1)
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=_pytree_handler())
    assert mngr.save(3, args=ocp.args.PyTreeSave(saved))
    mngr.wait_until_finished()
    # Every jax array is in the group's index, the data in the pack; the
    # others went to Orbax's own handlers.
    index = _index(tmp_path / "3" / "default")
    assert set(index["leaves"]) == {
        "params.w",
        "params.b",
        "params.ids",
        "params.mask",
        "rng",
        "empty",
    }
    assert index["leaves"]["params.w"]["data"] == "packed"
    assert index["leaves"]["empty"]["data"] == "none"
    assert index["leaves"]["rng"]["dtype"] == "key<fry>"
    # Into a differently initialised target: the values come from disk.
    target = _abstract(_state(2))
    restored = mngr.restore(
        3,
        args=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
        ),
    )
    _assert_bitwise(restored, saved)
    # Without args: every leaf as saved, arrays on the saved sharding.
    _assert_bitwise(mngr.restore(3), saved)
    meta = mngr.item_metadata(3)["params"]["w"]
    assert isinstance(meta, ocp.metadata.ArrayMetadata)
    assert (meta.shape, meta.dtype) == ((32, 16), jnp.float32)
    assert meta.sharding == ocp.metadata.SingleDeviceShardingMetadata.from_jax_sharding(
        saved["params"]["w"].sharding
    )
    mngr.close()


def test_a_restore_casts_to_the_dtype_asked_for(tmp_path):
    saved = {"w": jnp.linspace(-3.0, 3.0, 96).reshape(8, 12), "n": jnp.arange(7)}
    _save_pytree(tmp_path / "ckpt", saved)
    target = {
        "w": jax.ShapeDtypeStruct((8, 12), jnp.bfloat16, sharding=saved["w"].sharding),
        "n": jax.ShapeDtypeStruct((7,), jnp.float32, sharding=saved["n"].sharding),
    }
    restored = _restore_pytree(tmp_path / "ckpt", target)
    assert restored["w"].dtype == jnp.bfloat16 and restored["n"].dtype == jnp.float32
    np.testing.assert_array_equal(restored["w"], saved["w"].astype(jnp.bfloat16))
    np.testing.assert_array_equal(restored["n"], np.arange(7, dtype=np.float32))


def test_restore_args_name_the_sharding_in_each_of_orbax_ways(tmp_path):
    saved = {k: jnp.arange(6.0) + i for i, k in enumerate("abcd")}
    _save_pytree(tmp_path / "ckpt", saved)
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    args = {
        "a": ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=jax.sharding.PartitionSpec()),
        "b": ocp.ArrayRestoreArgs(
            sharding=ocp.metadata.SingleDeviceShardingMetadata(str(device))
        ),
        "c": ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(device)),
        "d": ocp.RestoreArgs(),  # the saved sharding
    }
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        restored = ckptr.restore(
            tmp_path / "ckpt", args=ocp.args.PyTreeRestore(restore_args=args)
        )
    assert restored["a"].sharding == jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()
    )
    for k in "bcd":
        assert restored[k].sharding == jax.sharding.SingleDeviceSharding(device)
    _assert_bitwise(restored, saved)


def test_leaves_restore_as_numpy_when_asked(tmp_path):
    saved = _state(1)
    _save_pytree(tmp_path / "ckpt", saved)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
    args["params"]["b"] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32)
    args["rng"] = ocp.ArrayRestoreArgs(sharding=_one_device())
    args["step"] = ocp.RestoreArgs()
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        restored = ckptr.restore(
            tmp_path / "ckpt", args=ocp.args.PyTreeRestore(restore_args=args)
        )
    for name in ("w", "ids", "mask"):
        got, want = restored["params"][name], saved["params"][name]
        assert type(got) is np.ndarray, (name, type(got))
        np.testing.assert_array_equal(got, np.asarray(want), strict=True)
    b = restored["params"]["b"]
    assert type(b) is np.ndarray and b.dtype == np.float32
    np.testing.assert_array_equal(b, np.asarray(saved["params"]["b"], np.float32))
    assert type(restored["empty"]) is np.ndarray and restored["empty"].shape == (0, 4)
    np.testing.assert_array_equal(restored["stats"], saved["stats"])  # Orbax's own
    _assert_bitwise(restored["rng"], saved["rng"])
    # (Failing restores here ask for this handler's leaves alone: Orbax drops
    # the reads of other handlers' leaves on an error, which Python reports.)
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        with pytest.raises(
            oeqx.CheckpointMismatchError,
            match=re.escape(
                "  - Leaf `rng` holds typed PRNG keys; the restore asks for "
                "numpy.\nTyped PRNG keys restore as jax arrays only: ask for "
                "`jax.Array`."
            ),
        ):
            ckptr.restore(
                tmp_path / "ckpt",
                args=ocp.args.PyTreeRestore(
                    _abstract({"rng": saved["rng"]}),
                    restore_args={"rng": ocp.RestoreArgs(restore_type=np.ndarray)},
                    partial_restore=True,
                ),
            )


def test_save_args_dtype_stores_the_cast_values(tmp_path):
    saved = {"w": jnp.linspace(-3.0, 3.0, 96).reshape(8, 12), "rng": jax.random.key(4)}
    # Typed PRNG keys have no other dtype: kept as they are.
    save_args = {"w": ocp.SaveArgs(dtype=jnp.bfloat16), "rng": ocp.SaveArgs(jnp.int8)}
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        ckptr.save(tmp_path / "c", args=ocp.args.PyTreeSave(saved, save_args=save_args))
    record = _index(tmp_path / "c")["leaves"]["w"]
    assert (record["dtype"], record["nbytes"]) == ("bfloat16", 96 * 2)
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        restored = ckptr.restore(tmp_path / "c")
    assert restored["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(restored["w"], saved["w"].astype(jnp.bfloat16))
    _assert_bitwise(restored["rng"], saved["rng"])


def test_partial_restore_reads_only_the_leaves_asked_for(tmp_path):
    saved = _state(1)
    _save_pytree(tmp_path / "ckpt", saved)
    # Damage one leaf's bytes in the pack: a restore that reads it fails...
    index = _index(tmp_path / "ckpt")
    record = index["leaves"]["params.ids"]
    pack = _group(tmp_path / "ckpt") / index["packs"][0]["file"]
    data = bytearray(pack.read_bytes())
    data[record["offset"] + 5] ^= 0x10
    pack.write_bytes(bytes(data))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"Leaf `\['params'\]\['ids'\]` \(params.ids\): XXH3-64 recorded at "
        r"save 0x[0-9a-f]{16}, computed from the data now 0x[0-9a-f]{16}\.\n"
        r"[\s\S]*\(Saved through `oeqx.type_handler_registry\(\)`, this checkpoint "
        r"has no sidecar, so `verify` cannot read it",
    ):
        # (This handler's leaves alone: see `test_leaves_restore_as_numpy...`.)
        params = _abstract(_state(2)["params"])
        _restore_pytree(tmp_path / "ckpt", {"params": params}, partial_restore=True)
    # ... and one that leaves it out never reads it.
    wanted = {"params": {"w": saved["params"]["w"]}, "step": 0}
    restored = _restore_pytree(
        tmp_path / "ckpt", _abstract(wanted), partial_restore=True
    )
    _assert_bitwise(restored, {"params": {"w": saved["params"]["w"]}, "step": 1})


def test_a_donated_array_does_not_change_what_was_saved(tmp_path):
    x = jnp.arange(4096.0)
    want = np.asarray(x).copy()
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=_pytree_handler())
    mngr.save(1, args=ocp.args.PyTreeSave({"x": x}))
    # Before the background write: donate the saved array's buffer.
    y = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)(x)
    mngr.wait_until_finished()
    restored = mngr.restore(1)
    np.testing.assert_array_equal(np.asarray(restored["x"]), want)
    np.testing.assert_array_equal(np.asarray(y), np.full(4096, -1.0))
    mngr.close()


def test_checkpoints_of_orbax_own_handler_still_restore(tmp_path):
    saved = {k: v for k, v in _state(1).items() if k != "empty"}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "plain", args=ocp.args.PyTreeSave(saved))
    target = _abstract({k: v for k, v in _state(2).items() if k != "empty"})
    _assert_bitwise(_restore_pytree(tmp_path / "plain", target), saved)
    meta = _pytree_handler().metadata(tmp_path / "plain").tree["params"]["w"]
    assert (meta.shape, meta.dtype) == ((32, 16), jnp.float32)


def test_orbax_without_the_registry_names_the_missing_handler(tmp_path):
    _save_pytree(tmp_path / "ckpt", {"w": jnp.ones(3)})
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        with pytest.raises(
            ValueError, match=f"TypeHandler lookup failed for: type={TYPESTR},"
        ):
            ckptr.restore(tmp_path / "ckpt")


def test_the_global_registry_is_left_alone():
    before = ocp.type_handlers.get_type_handler(jax.Array)
    registry = oeqx.type_handler_registry()
    assert isinstance(registry.get(jax.Array), oeqx.PackedArrayHandler)
    assert isinstance(registry.get(type(jnp.ones(2))), oeqx.PackedArrayHandler)
    assert registry.get(str) is ocp.type_handlers.get_type_handler(str)
    numpy_handler = ocp.type_handlers.get_type_handler(np.ndarray)
    assert registry.get(np.ndarray).typestr() == numpy_handler.typestr()
    assert ocp.type_handlers.get_type_handler(jax.Array) is before
    assert not isinstance(before, oeqx.PackedArrayHandler)
    # A handler added to the registry comes first, and stays local.
    registry.add(jax.Array, before, override=True)
    assert registry.get(jax.Array) is before
    assert not registry.has("no such type")


def test_a_shape_that_differs_is_an_error_unless_not_strict(tmp_path):
    saved = {"w": jnp.arange(32.0).reshape(4, 8), "v": jnp.arange(6.0)}
    _save_pytree(tmp_path / "ckpt", saved)
    sharding = saved["w"].sharding
    target = {
        "w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding),
        "v": jax.ShapeDtypeStruct((6, 1), jnp.float32, sharding=sharding),
    }
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=re.escape(
            "Cannot restore these leaves from the checkpoint in "
            f"{tmp_path / 'ckpt'}:\n"
            "  - Leaf `v` has shape (6,) in the checkpoint; the restore asks "
            "for (6, 1).\n"
            "  - Leaf `w` has shape (4, 8) in the checkpoint; the restore asks "
            "for (8, 4).\n"
            "Restore into a target of the saved shape (`metadata()` lists them); "
            "to truncate or zero-pad along the same dimensions, pass "
            "`ArrayRestoreArgs(..., strict=False)`"
        ),
    ):
        _restore_pytree(tmp_path / "ckpt", target)
    # Not strict, along the same dimensions: truncated and zero-padded.
    args = {
        "w": ocp.ArrayRestoreArgs(sharding=sharding, global_shape=(6, 3), strict=False),
        "v": ocp.ArrayRestoreArgs(sharding=sharding, global_shape=(9,), strict=False),
    }
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        restored = ckptr.restore(
            tmp_path / "ckpt", args=ocp.args.PyTreeRestore(restore_args=args)
        )
    want = np.zeros((6, 3), np.float32)
    want[:4] = np.arange(32.0).reshape(4, 8)[:, :3]
    np.testing.assert_array_equal(restored["w"], want)
    np.testing.assert_array_equal(restored["v"], [0, 1, 2, 3, 4, 5, 0, 0, 0])


def test_keys_restore_only_as_keys(tmp_path):
    _save_pytree(tmp_path / "ckpt", {"rng": jax.random.split(jax.random.key(0), 3)})
    args = {"rng": ocp.ArrayRestoreArgs(sharding=_one_device(), dtype=jnp.float32)}
    with ocp.Checkpointer(_pytree_handler()) as ckptr:
        with pytest.raises(
            oeqx.CheckpointMismatchError,
            match=re.escape(
                "  - Leaf `rng` is key<fry> in the checkpoint; the restore asks "
                "for float32.\nTyped PRNG keys restore as the keys they are: ask "
                "for their saved dtype."
            ),
        ):
            ckptr.restore(
                tmp_path / "ckpt", args=ocp.args.PyTreeRestore(restore_args=args)
            )


def _one_device():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_a_damaged_or_missing_index_is_named(tmp_path):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.ones(3), "v": jnp.ones(2)})
    group = _group(path)
    index = group / "orbax_eqx.json"
    target = _abstract({"w": jnp.ones(3), "v": jnp.ones(2)})
    sidecars.edit(group, lambda c: c["leaves"].pop("v"))  # resealed
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=re.escape(
            f"The sidecar {index} of arrays saved with orbax_eqx's type handler is "
            "damaged: its leaves are not those its group was named for. Restore an "
            "earlier step, or re-save this one."
        ),
    ):
        _restore_pytree(path, target)
    index.write_text("{not json")
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=re.escape(f"The sidecar {index} is not JSON as orbax_eqx writes it"),
    ):
        _restore_pytree(path, target)
    index.unlink()
    with pytest.raises(oeqx.CheckpointDamagedError, match="is damaged: it is missing"):
        _restore_pytree(path, target)
    # The group replaced by another checkpoint's, which lacks a leaf: this
    # checkpoint's seal names a group directory that is not there.
    other = _save_pytree(tmp_path / "other", {"w": jnp.zeros(3)})
    other_seal = f"orbax_eqx~typed-seal.{_group(other).name.split('.')[-1]}"
    shutil.rmtree(group)
    _group(other).rename(path / _group(other).name)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=re.escape(
            f"The arrays saved with orbax_eqx's type handler in {path} are "
            f"incomplete: the directory {group.name} that "
            f"orbax_eqx~typed-seal.{group.name.split('.')[-1]} seals is missing "
            "(deleted, or never copied). Restore an earlier step, or re-save this "
            "one."
        ),
    ):
        _restore_pytree(path, target)
    # Without this checkpoint's seal either: no index lists the leaf.
    (path / f"orbax_eqx~typed-seal.{group.name.split('.')[-1]}").unlink()
    shutil.copy(other / other_seal, path)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=re.escape(
            f"No index of arrays saved with orbax_eqx's type handler in {path} "
            f"lists these leaves (it has {_group(path).name}):\n  - Leaf `v`\n"
        ),
    ) as info:
        _restore_pytree(path, target)
    assert info.value.file == str(path)
    assert info.value.leaves == ("v",)
    assert info.value.remedy.startswith("Restore an earlier step")


@pytest.mark.parametrize(
    "plant, what",
    [
        (os.mkfifo, r"a FIFO \(named pipe\)"),
        (lambda p: os.symlink("/dev/zero", p), "a character device"),
    ],
    ids=["fifo", "dev_zero"],
)
def test_an_index_that_would_never_end_is_refused_unread(tmp_path, plant, what):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.ones(3)})
    index = _group(path) / "orbax_eqx.json"
    index.unlink()
    plant(index)
    target = _abstract({"w": jnp.ones(3)})
    raised = raised_by(lambda: _restore_pytree(path, target), index)
    assert isinstance(raised, oeqx.CheckpointDamagedError), raised
    assert re.match(
        re.escape(f"The sidecar {index} is ") + f"{what}, not a regular file",
        str(raised),
    ), raised


def test_a_damaged_index_record_is_named(tmp_path):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.ones(3)})
    sidecars.edit(_group(path), lambda c: c["leaves"]["w"].update(offset=10**9))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"damaged: leaf 'w' ends at byte 1000000012 of pack 0, which holds "
        r"12\.",
    ):
        _restore_pytree(path, _abstract({"w": jnp.ones(3)}))


def _edit_w(**fields):
    def edit(content):
        content["leaves"]["w"].update(fields)

    return edit


@pytest.mark.parametrize(
    "edit, problem",
    [
        (
            _edit_w(xxh3="XYZ"),
            r"leaf 'w' is malformed \(Expected `str` matching regex",
        ),
        (_edit_w(xxh3=7), r"leaf 'w' is malformed \(Expected `str \| null`, got `int`"),
        (
            lambda c: c.update(format_version=True),
            r'"format_version" is not an integer',
        ),
    ],
    ids=["xxh3-not-hex", "xxh3-an-int", "version-bool"],
)
def test_a_group_sidecar_is_checked_as_any_sidecar(tmp_path, edit, problem):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.ones(3)})
    sidecars.edit(_group(path), edit)  # resealed: the rules are probed
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"damaged: " + problem):
        _restore_pytree(path, _abstract({"w": jnp.ones(3)}))


def test_only_jax_arrays_are_saved_by_it(tmp_path):
    registry = oeqx.type_handler_registry()
    registry.add(np.ndarray, oeqx.PackedArrayHandler())
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    with ocp.Checkpointer(handler) as ckptr:
        with pytest.raises(
            oeqx.UnsupportedLeafError,
            match=re.escape(
                "PackedArrayHandler saves jax arrays only:\n  - Leaf `x` is a "
                "numpy.ndarray, not a jax.Array.\nRegister it for jax.Array alone"
            ),
        ):
            ckptr.save(tmp_path / "ckpt", args=ocp.args.PyTreeSave({"x": np.ones(2)}))


def test_primary_host_none_is_refused():
    with pytest.raises(
        oeqx.OrbaxEqxError,
        match=re.escape(
            "PackedArrayHandler(primary_host=None): expected the index of the "
            "process that writes the pack and the index"
        ),
    ):
        oeqx.type_handler_registry(primary_host=None)
    with pytest.raises(ValueError, match=r"primary_host=-1\)"):
        oeqx.type_handler_registry(primary_host=-1)


def test_registered_globally_it_says_what_a_plain_checkpoint_lacks(tmp_path):
    """Against the advice, registered in Orbax's global registry: a checkpoint
    of Orbax's own handler has no handler left to read it, which is said."""
    saved = {"w": jnp.ones(3)}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "plain", args=ocp.args.PyTreeSave(saved))
    original = ocp.type_handlers.get_type_handler(jax.Array)
    ocp.type_handlers.register_type_handler(
        jax.Array, oeqx.PackedArrayHandler(), override=True
    )
    try:
        with pytest.raises(
            oeqx.CheckpointDamagedError,
            match=re.escape(
                f"{tmp_path / 'plain'} holds no orbax_eqx~typed.* directory, so none "
                "of its arrays was saved with orbax_eqx's type handler"
            ),
        ) as info:
            _restore_pytree(tmp_path / "plain", _abstract(saved))
        assert info.value.file == str(tmp_path / "plain")
        assert info.value.remedy.startswith("Restore an earlier step")
    finally:
        ocp.type_handlers.register_type_handler(jax.Array, original, override=True)
    assert ocp.type_handlers.get_type_handler(jax.Array) is original


# --- groups bound to their checkpoint (index format 2 on) ---------------------


def _seal(item_dir: Path) -> Path:
    return item_dir / f"orbax_eqx~typed-seal.{_group(item_dir).name.split('.')[-1]}"


def _belongs_not(path, problem):
    return re.escape(
        f"The arrays saved with orbax_eqx's type handler in {_group(path)} do not "
        f"belong to the checkpoint in {path}: {problem}. Restore an earlier step, "
        "or re-save this one (never copy a group directory between checkpoints)."
    )


@pytest.mark.parametrize(
    "tree",
    [
        {"w": jnp.arange(3.0), "v": jnp.arange(2)},
        {"w": jnp.arange(3.0), "k": jax.random.split(jax.random.key(0), 2)},
    ],
    ids=["arrays", "with-keys"],
)
def test_a_group_directory_from_another_checkpoint_is_refused(tmp_path, tree):
    path = _save_pytree(tmp_path / "ckpt", tree)
    other_tree = jax.tree.map(lambda x: x if x.dtype != jnp.float32 else x + 1, tree)
    other = _save_pytree(tmp_path / "other", other_tree)
    assert _group(path).name == _group(other).name  # named by the leaf names
    shutil.rmtree(_group(path))
    shutil.copytree(_group(other), _group_dir_in(path, other))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_belongs_not(
            path,
            f"its sidecar is not the one {_seal(path).name} beside it was sealed "
            "with: the directory was copied in from another checkpoint, or its "
            "sidecar was edited",
        ),
    ):
        _restore_pytree(path, _abstract(tree))


def _group_dir_in(path, other):
    return path / _group(other).name


def test_an_edited_index_is_refused_by_the_seal(tmp_path):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.arange(4.0), "v": jnp.ones(4)})

    def swap(content):  # `w` and `v` swap places in the pack
        w, v = content["leaves"]["w"], content["leaves"]["v"]
        for key in ("offset", "xxh3"):
            w[key], v[key] = v[key], w[key]

    sidecars.edit(_group(path), swap)  # resealed: only the seal beside it tells
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"its sidecar was edited"):
        _restore_pytree(path, _abstract({"w": jnp.ones(4), "v": jnp.ones(4)}))


def test_a_missing_seal_is_named(tmp_path):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.arange(4.0)})
    seal = _seal(path)
    seal.unlink()
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_belongs_not(
            path,
            f"{seal.name} beside it, which binds it to this checkpoint, is missing",
        ),
    ):
        _restore_pytree(path, _abstract({"w": jnp.ones(4)}))


def test_a_deleted_group_directory_is_named(tmp_path):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.arange(4.0)})
    group = _group(path)
    seal = _seal(path)
    shutil.rmtree(group)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=re.escape(
            f"The arrays saved with orbax_eqx's type handler in {path} are "
            f"incomplete: the directory {group.name} that {seal.name} seals is "
            "missing (deleted, or never copied)."
        ),
    ):
        _restore_pytree(path, _abstract({"w": jnp.ones(4)}))


_FULL_DISK_WORKER = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
import jax.numpy as jnp, orbax.checkpoint as ocp, orbax_eqx as oeqx
handler = ocp.PyTreeCheckpointHandler(
    type_handler_registry=oeqx.type_handler_registry()
)
mngr = ocp.CheckpointManager(sys.argv[1], item_handlers=handler)
mngr.save(0, args=ocp.args.PyTreeSave({"w": jnp.ones(4)}))
mngr.wait_until_finished()
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
try:
    mngr.save(1, args=ocp.args.PyTreeSave({"w": jnp.ones(1 << 16)}))
    mngr.wait_until_finished()
except OSError as e:
    print("NOTES", *getattr(e, "__notes__", []), sep="\\n")
"""


@pytest.mark.slow
def test_a_failed_background_write_names_its_step(tmp_path):
    # A write that fails for want of space (here a file-size limit: the
    # same OSError path) says which step it stopped.
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_WORKER, str(tmp_path / "run")],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        f"orbax_eqx: this error stopped the background save of step `1` "
        f"({tmp_path / 'run' / '1' / 'default'}). That step was not committed; the "
        "steps saved before it are intact."
    ) in proc.stdout.splitlines(), proc.stdout


def test_groups_and_seals_deleted_are_named(tmp_path):
    path = _save_pytree(tmp_path / "ckpt", {"w": jnp.arange(4.0), "v": jnp.ones(2)})
    shutil.rmtree(_group(path))
    for seal in path.glob("orbax_eqx~typed-seal.*"):
        seal.unlink()
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=re.escape(f"Orbax's metadata in {path} says its arrays (such as `['")
        + r"\w'\]`\) "
        + re.escape(
            "were saved with orbax_eqx's type handler, but it holds no "
            "orbax_eqx~typed.* directory: they were deleted, or not copied with "
            "the checkpoint."
        ),
    ) as info:
        _restore_pytree(path, _abstract({"w": jnp.ones(4), "v": jnp.ones(2)}))
    assert info.value.file == str(path)
    assert sorted(info.value.leaves) == ["v", "w"]
    assert info.value.remedy.startswith("Restore an earlier step")


def test_the_index_and_seal_are_never_written_through_a_planted_link(tmp_path):
    # Links planted where the handler writes its index and its seal (their
    # names follow from the leaf names, so an attacker can know them), and at
    # the temporary name the handler once wrote through (`{final}.tmp-{pid}`):
    # each file is written as a file of its own, the linked file untouched.
    tree = {"w": jnp.arange(8.0), "b": jnp.ones(3)}
    group = _group(_save_pytree(tmp_path / "first", tree)).name
    seal = group.replace("orbax_eqx~typed.", "orbax_eqx~typed-seal.")
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    planted = tmp_path / "planted"
    (planted / group).mkdir(parents=True)
    index = planted / group / "orbax_eqx.json"
    old_tmp = planted / group / f"orbax_eqx.json.tmp-{os.getpid()}"
    for link in (index, planted / seal, old_tmp):
        os.symlink(outside, link)
    # The handler itself, into the directory: a `Checkpointer` would save into
    # a temporary directory of its own, past the planted links.
    handler = _pytree_handler()
    handler.save(planted, args=ocp.args.PyTreeSave(tree))
    handler.finalize(planted)
    assert outside.read_bytes() == b"precious"
    assert not index.is_symlink() and not (planted / seal).is_symlink()
    assert old_tmp.is_symlink()  # left alone
    assert _index(planted)["leaves"].keys() == {"w", "b"}
    _assert_bitwise(_restore_pytree(planted, _abstract(tree)), tree)
