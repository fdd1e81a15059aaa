"""Orbax's v1 API (`orbax.checkpoint.v1`) with Equinox modules, no set-up.

Importing orbax_eqx registers `EqxCheckpointableHandler` in Orbax's global v1
registry: checkpointables holding a module go through orbax_eqx (the same
files, sidecar, checks and errors as `EqxHandler`), everything else stays with
Orbax's own handlers. Checkpoints written through either API read through both
(an async save held in flight: `tests/test_staged_faults.py`).
"""

import gc
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp0
import pytest
import zoo
from entry import main as cli_main
from orbax.checkpoint import v1 as ocp

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)


def _train_state(key):
    """`{"model": a transformer block, "opt_state": its optax state}`."""
    model = zoo.transformer_block(key)
    params = eqx.filter(model, eqx.is_array)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = opt.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {"model": model, "opt_state": opt_state}


def _abstract_train_state(key=KEY_SKELETON):
    return eqx.filter_eval_shape(_train_state, key)


def _assert_arrays_equal(restored, expected):
    r_leaves, r_def = jax.tree_util.tree_flatten(restored)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    assert r_def == e_def
    for r, e in zip(r_leaves, e_leaves, strict=True):
        assert r.dtype == e.dtype and r.shape == e.shape
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e))


@pytest.fixture
def saved(tmp_path):
    """A v1 checkpoint of `_train_state(KEY_SAVE)`, and the state saved."""
    state = _train_state(KEY_SAVE)
    path = tmp_path / "ckpt"
    ocp.save_checkpointables(path, state)
    return path, state


# ------------------------------------------------------------ registration


def test_registered_globally_on_import():
    entries = ocp.handlers.global_registry().get_all_entries()
    assert (oeqx.EqxCheckpointableHandler, None) in entries


def _opt_state(key):
    return _train_state(key)["opt_state"]


HANDLEABLE = {
    "module": lambda k: zoo.transformer_block(k),
    "model-and-state": zoo.batchnorm_state,
    "dict-with-module": lambda k: {"model": zoo.mlp(k), "step": 3},
    "model-and-optax-state": lambda k: _train_state(k),
    "shared": zoo.shared_tied,
    "module-without-arrays": lambda k: eqx.nn.Lambda(jax.nn.relu),
}
NOT_HANDLEABLE = {
    "dict-of-arrays": lambda k: {"w": jax.random.normal(k, (3,)), "b": jnp.zeros(2)},
    "optax-state": _opt_state,
    "jax-array": lambda k: jax.random.normal(k, (4,)),
    "numpy-array": lambda k: np.zeros(3),
    "python-values": lambda k: {"step": 3, "name": "run"},
}


@pytest.mark.parametrize("make", HANDLEABLE.values(), ids=HANDLEABLE.keys())
@pytest.mark.slow
def test_claims_trees_holding_a_module(make):
    handler = oeqx.EqxCheckpointableHandler()
    assert handler.is_handleable(make(KEY_SAVE))
    assert handler.is_abstract_handleable(eqx.filter_eval_shape(make, KEY_SAVE))


@pytest.mark.parametrize("make", NOT_HANDLEABLE.values(), ids=NOT_HANDLEABLE.keys())
def test_leaves_everything_else_to_orbax(make):
    handler = oeqx.EqxCheckpointableHandler()
    assert not handler.is_handleable(make(KEY_SAVE))
    assert not handler.is_abstract_handleable(eqx.filter_eval_shape(make, KEY_SAVE))


def test_wrappers_are_claimed_whatever_they_hold(tmp_path):
    handler = oeqx.EqxCheckpointableHandler()
    plain = {"w": jnp.arange(3.0), "note": "x"}
    skeleton = {"w": jax.ShapeDtypeStruct((3,), jnp.float32), "note": ""}
    assert handler.is_handleable(oeqx.EqxSave(plain))
    assert handler.is_abstract_handleable(oeqx.EqxRestore(skeleton))
    assert handler.is_abstract_handleable(oeqx.EqxRestore(None))

    ocp.save_checkpointables(tmp_path / "ckpt", {"plain": oeqx.EqxSave(plain)})
    assert (tmp_path / "ckpt" / "plain" / "orbax_eqx.json").exists()
    loaded = ocp.load_checkpointables(
        tmp_path / "ckpt", {"plain": oeqx.EqxRestore(skeleton)}
    )
    zoo.assert_same(loaded["plain"], plain)


# ------------------------------------------------------- save and load


def test_model_through_orbax_eqx_optax_state_through_orbax(saved):
    path, _ = saved
    assert (path / "model" / "orbax_eqx.json").exists()
    assert not (path / "opt_state" / "orbax_eqx.json").exists()
    found = ocp.checkpointables_metadata(path).metadata
    assert isinstance(found["model"], oeqx.Metadata)
    assert "attn.query_proj.weight" in found["model"].leaves
    assert not isinstance(found["opt_state"], oeqx.Metadata)
    handlers = json.loads((path / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert handlers["model"] == "orbax_eqx.EqxCheckpointableHandler"
    assert handlers["opt_state"].endswith(".PyTreeHandler")


def test_load_checkpointables_into_a_differently_initialised_skeleton(saved):
    path, state = saved
    loaded = ocp.load_checkpointables(path, _abstract_train_state())
    zoo.assert_same(loaded["model"], state["model"])
    _assert_arrays_equal(loaded["opt_state"], state["opt_state"])
    # And the model alone.
    alone = ocp.load_checkpointables(path, {"model": _abstract_train_state()["model"]})
    assert list(alone) == ["model"]
    zoo.assert_same(alone["model"], state["model"])


def test_load_without_abstract_checkpointable_gives_flat_dict(saved):
    path, state = saved
    loaded = ocp.load_checkpointables(path, {"model": None})["model"]
    assert set(loaded) == set(oeqx.metadata(path / "model").leaves)
    np.testing.assert_array_equal(
        loaded["attn.query_proj.weight"], state["model"].attn.query_proj.weight
    )


def _block_skeleton(**changes):
    return eqx.filter_eval_shape(lambda k: zoo.Block(k, **changes), KEY_SKELETON)


@pytest.mark.parametrize(
    "skeleton, expected",
    [
        (
            _block_skeleton(num_heads=4),
            r"Static field `num_heads` of module `<root>` is 4 in the skeleton but 2 "
            r"in the checkpoint",
        ),
        (
            _block_skeleton(dim=16),
            r"Leaf `norm.weight` has shape \(16,\) in the skeleton but \(8,\) in "
            r"the checkpoint",
        ),
        (
            eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON),
            r"is in the checkpoint but not in the skeleton",
        ),
    ],
    ids=["num_heads", "shape", "other-model"],
)
def test_mismatches_raise_as_eqx_restore_raises(saved, skeleton, expected):
    path, _ = saved
    with pytest.raises(oeqx.CheckpointMismatchError, match=expected) as v1_error:
        ocp.load_checkpointables(path, {"model": skeleton})
    handler = oeqx.EqxHandler()
    with pytest.raises(oeqx.CheckpointMismatchError) as v0_error:
        handler.restore(path / "model", args=oeqx.EqxRestore(skeleton))
    handler.close()
    assert str(v1_error.value) == str(v0_error.value)


def test_saving_a_skeleton_fails_and_leaves_nothing(tmp_path):
    path = tmp_path / "ckpt"
    # Orbax has made its directory-creating coroutine before any handler runs,
    # and drops it unawaited when one raises; Python warns when it is freed.
    with pytest.warns(RuntimeWarning, match="'_create_paths' was never awaited"):
        with pytest.raises(
            oeqx.UnsupportedLeafError,
            match=r"Leaf `attn.query_proj.weight` is a jax.ShapeDtypeStruct, "
            r"which holds no data to save",
        ):
            ocp.save_checkpointables(path, {"model": _block_skeleton()})
        gc.collect()
    assert not path.exists()


# ------------------------------------------------------ restore options


@pytest.fixture
def saved_item(tmp_path):
    """`{"model": ..., "step": 3, "note": ...}` as one checkpointable."""
    item = {"model": zoo.transformer_block(KEY_SAVE), "step": 3, "note": "hi"}
    ocp.save_checkpointables(tmp_path / "ckpt", {"train": item})
    return tmp_path / "ckpt", item


def _load_state(path, abstract):
    return ocp.load_checkpointables(path, {"train": abstract})["train"]


def test_option_strict_false_restores_part(saved_item):
    path, item = saved_item
    skeleton = {"model": _block_skeleton()}
    with pytest.raises(oeqx.CheckpointMismatchError, match=r"Leaf `step`"):
        _load_state(path, skeleton)
    restored = _load_state(path, oeqx.EqxRestore(skeleton, strict=False))
    zoo.assert_same(restored, {"model": item["model"]})


def test_option_prefix(saved_item):
    path, item = saved_item
    restored = _load_state(path, oeqx.EqxRestore(_block_skeleton(), prefix="model"))
    zoo.assert_same(restored, item["model"])


def test_option_renames_and_report(saved_item):
    path, item = saved_item
    skeleton = {"net": _block_skeleton(), "step": 0, "note": ""}
    renames = oeqx.StateDictMapping().rename_regex(r"net\.(.*)", r"model.\1")
    restored, report = _load_state(
        path, oeqx.EqxRestore(skeleton, renames=renames, report=True)
    )
    zoo.assert_same(restored, {"net": item["model"], "step": 3, "note": "hi"})
    assert report.renamed


def test_option_missing_keep(saved_item):
    path, item = saved_item
    fresh_head = jnp.full((3,), 7.0)
    skeleton = {**item, "model": _block_skeleton(), "head": fresh_head}
    with pytest.raises(oeqx.CheckpointMismatchError, match=r"Leaf `head`"):
        _load_state(path, skeleton)
    restored, report = _load_state(
        path, oeqx.EqxRestore(skeleton, missing="keep", report=True)
    )
    zoo.assert_same(restored, {**item, "head": fresh_head})
    assert report.kept == ("head",)


def _to_bf16(x):
    if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating):
        return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    return x


def test_option_cast_and_shardings(saved_item):
    path, item = saved_item
    skeleton = {**item, "model": jax.tree.map(_to_bf16, _block_skeleton())}
    with pytest.raises(oeqx.CheckpointMismatchError, match="bfloat16"):
        _load_state(path, skeleton)
    device = jax.devices()[0]
    restored = _load_state(
        path,
        oeqx.EqxRestore(
            skeleton, cast=True, shardings=jax.sharding.SingleDeviceSharding(device)
        ),
    )
    weight = restored["model"].attn.query_proj.weight
    assert weight.dtype == jnp.bfloat16 and weight.devices() == {device}
    np.testing.assert_array_equal(
        weight, item["model"].attn.query_proj.weight.astype(jnp.bfloat16)
    )


# ------------------------------------------------------------- training


def _losses_run(root, policy, losses):
    """Saves one MLP per step through `ocp.training.Checkpointer`; returns them."""
    models = {step: zoo.mlp(jax.random.key(step)) for step in losses}
    with ocp.training.Checkpointer(root, preservation_policy=policy) as ckptr:
        for step, loss in losses.items():
            assert ckptr.save_checkpointables(
                step,
                {"model": models[step], "opt_state": {"count": jnp.asarray(step)}},
                metrics={"loss": loss},
            )
        kept = [c.step for c in ckptr.checkpoints]
    return models, kept


def _load_steps(root, steps, models):
    skeleton = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    abstract_count = {"count": jax.ShapeDtypeStruct((), jnp.int32)}
    with ocp.training.Checkpointer(root) as ckptr:
        for step in steps:
            loaded = ckptr.load_checkpointables(
                step, {"model": skeleton, "opt_state": abstract_count}
            )
            zoo.assert_same(loaded["model"], models[step])
            assert int(loaded["opt_state"]["count"]) == step


def test_training_checkpointer_best_n(tmp_path):
    policy = ocp.training.preservation_policies.BestN(
        get_metric_fn=lambda metrics: metrics["loss"], reverse=True, n=2
    )
    losses = {0: 0.5, 1: 0.2, 2: 0.9, 3: 0.1, 4: 0.3}
    models, kept = _losses_run(tmp_path, policy, losses)
    assert kept == [1, 3]  # the two lowest losses
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]
    _load_steps(tmp_path, kept, models)


def test_training_checkpointer_latest_n(tmp_path):
    policy = ocp.training.preservation_policies.LatestN(2)
    models, kept = _losses_run(tmp_path, policy, {0: 0.5, 1: 0.2, 2: 0.9})
    assert kept == [1, 2]
    _load_steps(tmp_path, kept, models)


# ----------------------------------------------------------- v0 and v1


def test_v0_checkpoint_loads_through_v1(tmp_path):
    state = _train_state(KEY_SAVE)
    mngr = ocp0.CheckpointManager(tmp_path, item_handlers={"model": oeqx.EqxHandler()})
    mngr.save(5, args=ocp0.args.Composite(model=oeqx.EqxSave(state["model"])))
    mngr.wait_until_finished()
    mngr.close()
    skeleton = _abstract_train_state()["model"]
    loaded = ocp.load_checkpointables(tmp_path / "5", {"model": skeleton})
    zoo.assert_same(loaded["model"], state["model"])
    with ocp.training.Checkpointer(tmp_path) as ckptr:
        loaded = ckptr.load_checkpointables(5, {"model": oeqx.EqxRestore(skeleton)})
        zoo.assert_same(loaded["model"], state["model"])
        # No abstract checkpointable: found by the handler name v0 recorded.
        flat = ckptr.load_checkpointables(5)["model"]
    assert set(flat) == set(oeqx.metadata(tmp_path / "5" / "model").leaves)


def test_v1_checkpoint_loads_through_v0_and_the_cli(saved, capsys):
    path, state = saved
    skeleton = _abstract_train_state()["model"]
    zoo.assert_same(oeqx.restore(path / "model", skeleton), state["model"])
    handler = oeqx.EqxHandler()
    zoo.assert_same(
        handler.restore(path / "model", args=oeqx.EqxRestore(skeleton)),
        state["model"],
    )
    handler.close()

    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"num_heads=2", out), out
    assert cli_main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"arrays .* match their checksums", out), out


def test_v1_root_loads_through_checkpoint_manager(tmp_path):
    models, _ = _losses_run(
        tmp_path, ocp.training.preservation_policies.LatestN(1), {4: 0.1}
    )
    mngr = ocp0.CheckpointManager(tmp_path, item_handlers={"model": oeqx.EqxHandler()})
    assert mngr.all_steps() == [4]
    skeleton = eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON)
    restored = mngr.restore(
        4, args=ocp0.args.Composite(model=oeqx.EqxRestore(skeleton))
    )
    zoo.assert_same(restored["model"], models[4])
    mngr.close()
