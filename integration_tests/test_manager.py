"""`EqxHandler` under a real `ocp.CheckpointManager`: retention, best step,
both spellings of the options, Composite items, restores without arguments."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx

from ._models import (
    BatchNormNet,
    assert_trees_equal,
    make_mlp,
    scaled,
    skeleton_mlp,
)

# One loss per step; the two lowest are steps 3 and 1, the latest is step 4.
LOSSES = [3.0, 1.0, 2.0, 0.5, 4.0]


def _model_at(step: int) -> eqx.nn.MLP:
    return scaled(make_mlp(jax.random.key(0)), step + 1.0)


def _legacy_manager(root, **options) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        root,
        item_handlers=oeqx.EqxHandler(),
        options=ocp.CheckpointManagerOptions(**options),
    )


@pytest.mark.parametrize(
    "best_mode, kept, best",
    [("min", [1, 3], 3), ("max", [0, 4], 4)],
    ids=["min-loss", "max-loss"],
)
def test_item_handlers_max_to_keep_and_best_step(tmp_path, best_mode, kept, best):
    mngr = _legacy_manager(
        tmp_path,
        max_to_keep=2,
        best_fn=lambda m: m["loss"],
        best_mode=best_mode,
    )
    for step, loss in enumerate(LOSSES):
        assert mngr.save(
            step, args=oeqx.EqxSave(_model_at(step)), metrics={"loss": loss}
        )
    mngr.wait_until_finished()

    # Orbax's policy: with `best_fn`, `max_to_keep` keeps the best two by metric.
    assert mngr.all_steps() == kept
    assert mngr.best_step() == best
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [
        str(s) for s in kept
    ]
    restored = mngr.restore(best, args=oeqx.EqxRestore(skeleton_mlp()))
    assert_trees_equal(restored, _model_at(best))
    # A live, differently initialised model is a skeleton too.
    live = make_mlp(jax.random.key(77))
    assert_trees_equal(mngr.restore(best, args=oeqx.EqxRestore(live)), _model_at(best))
    mngr.close()

    # A restarted job sees the same steps and best step (metrics are on disk).
    again = _legacy_manager(
        tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=best_mode
    )
    assert again.all_steps() == kept
    assert again.best_step() == best
    restored = again.restore(again.best_step(), args=oeqx.EqxRestore(skeleton_mlp()))
    assert_trees_equal(restored, _model_at(best))
    again.close()


def test_handler_registry_and_policies(tmp_path):
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("model", oeqx.EqxSave, oeqx.EqxHandler())
    registry.add("model", oeqx.EqxRestore, oeqx.EqxHandler())
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(2),
        preservation_policy=policies.AnyPreservationPolicy(
            [
                policies.LatestN(1),
                # Ascending sort keeps the last n: reverse it to keep the lowest.
                policies.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2),
            ]
        ),
    )
    mngr = ocp.CheckpointManager(tmp_path, options=options, handler_registry=registry)
    losses = [5.0, 9.0, 1.0, 9.0, 2.0, 9.0, 3.0, 9.0, 4.0, 9.0]
    saved = []
    for step, loss in enumerate(losses):
        args = ocp.args.Composite(model=oeqx.EqxSave(_model_at(step)))
        if mngr.save(step, args=args, metrics={"loss": loss}):
            saved.append(step)
    mngr.wait_until_finished()

    assert saved == [0, 2, 4, 6, 8]
    # Latest (8) plus the two lowest losses among saved steps (2, 4).
    assert mngr.all_steps() == [2, 4, 8]
    # Without `best_fn`, Orbax keeps metrics in memory only (`mngr.metrics(s)`
    # is None), so `best_step()` is not asked here; BestN saw them in memory.
    for step in mngr.all_steps():
        restored = mngr.restore(
            step, args=ocp.args.Composite(model=oeqx.EqxRestore(skeleton_mlp()))
        )
        assert_trees_equal(restored.model, _model_at(step))
    mngr.close()


# Losses of steps 0, 4, ..., 28: the two lowest are steps 24 and 28.
RESTART_LOSSES = {0: 5.0, 4: 1.0, 8: 2.0, 12: 9.0, 16: 9.0, 20: 9.0, 24: 0.5, 28: 0.7}


def _best_n_options(with_best_fn: bool) -> ocp.CheckpointManagerOptions:
    best_n = ocp.checkpoint_managers.BestN(
        get_metric_fn=lambda m: m["loss"], reverse=True, n=2
    )
    if not with_best_fn:
        return ocp.CheckpointManagerOptions(preservation_policy=best_n)
    # `best_fn` beside the policy: Orbax then writes each step's metrics to
    # disk, where a restarted manager (and `inspect`) reads them.
    return ocp.CheckpointManagerOptions(
        preservation_policy=best_n, best_fn=lambda m: m["loss"], best_mode="min"
    )


@pytest.mark.parametrize(
    "with_best_fn, kept, best, on_disk",
    [
        (True, [24, 28], 24, True),
        # Orbax 0.12.8 without `best_fn`: the metrics live in memory only, so
        # after a restart BestN never deletes the steps saved before it (4 and
        # 8 are kept, no metric to rank them by) and `best_step()` is the
        # latest, before a restart or after.
        (False, [4, 8, 24, 28], 28, False),
    ],
    ids=["policy-and-best_fn", "policy-alone"],
)
def test_best_n_across_a_restart(tmp_path, capsys, with_best_fn, kept, best, on_disk):
    from orbax_eqx.__main__ import main

    def manager():
        return ocp.CheckpointManager(
            tmp_path,
            item_handlers=oeqx.EqxHandler(),
            options=_best_n_options(with_best_fn),
        )

    mngr = manager()
    for step, loss in RESTART_LOSSES.items():
        if step == 16:  # the job restarts: a new manager over the same root
            mngr.wait_until_finished()
            mngr.close()
            mngr = manager()
        mngr.save(step, args=oeqx.EqxSave(_model_at(step)), metrics={"loss": loss})
    mngr.wait_until_finished()
    assert mngr.all_steps() == kept
    assert mngr.best_step() == best
    mngr.close()
    restarted = manager()  # what the next job sees
    assert restarted.best_step() == best
    restored = restarted.restore(best, args=oeqx.EqxRestore(skeleton_mlp()))
    assert_trees_equal(restored, _model_at(best))
    restarted.close()
    capsys.readouterr()
    assert main(["inspect", "--json", str(tmp_path)]) == 0  # it shows metrics
    steps = json.loads(capsys.readouterr().out)["steps"]
    metrics = {s["step"]: s["metrics"] for s in steps}
    if on_disk:
        assert metrics == {s: {"loss": RESTART_LOSSES[s]} for s in kept}
    else:
        assert metrics == {s: None for s in kept}


def test_composite_with_json_item(tmp_path):
    handlers = {"model": oeqx.EqxHandler(), "meta": ocp.JsonCheckpointHandler()}
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=handlers)
    model = _model_at(0)
    meta = {"lr": 0.001, "note": "warmup", "layers": [8, 8]}
    mngr.save(
        0,
        args=ocp.args.Composite(
            model=oeqx.EqxSave(model), meta=ocp.args.JsonSave(meta)
        ),
    )
    mngr.wait_until_finished()
    assert sorted(p.name for p in (tmp_path / "0").iterdir() if p.is_dir()) == [
        "meta",
        "model",
    ]

    both = mngr.restore(
        0,
        args=ocp.args.Composite(
            model=oeqx.EqxRestore(skeleton_mlp()), meta=ocp.args.JsonRestore()
        ),
    )
    assert_trees_equal(both.model, model)
    assert both.meta == meta
    only_model = mngr.restore(
        0, args=ocp.args.Composite(model=oeqx.EqxRestore(skeleton_mlp()))
    )
    assert_trees_equal(only_model.model, model)
    mngr.close()

    # The standalone API reads the item directory, or finds the one orbax_eqx
    # item of the step (`meta` is none).
    for path in [tmp_path / "0" / "model", tmp_path / "0"]:
        assert_trees_equal(oeqx.restore(path, skeleton_mlp()), model)


def _expected_flat(model: eqx.nn.MLP) -> dict:
    flat = {}
    for i, layer in enumerate(model.layers):
        flat[f"layers.{i}.weight"] = layer.weight
        flat[f"layers.{i}.bias"] = layer.bias
    return flat


def _check_flat(flat: dict, model: eqx.nn.MLP) -> None:
    expected = _expected_flat(model)
    assert set(flat) == set(expected) | {"activation", "final_activation"}
    for name, value in expected.items():
        assert isinstance(flat[name], jax.Array), name
        assert flat[name].dtype == value.dtype, name
        np.testing.assert_array_equal(flat[name], value, err_msg=name)
    # Callables come back as what the sidecar says of them, never imported.
    assert isinstance(flat["activation"], oeqx.RecordedLeaf)
    assert flat["activation"].kind == "callable"
    assert flat["activation"].description.endswith(".relu")


@pytest.mark.parametrize("composite", [False, True], ids=["default-item", "composite"])
def test_restore_without_args_and_from_fresh_manager(tmp_path, composite):
    model = _model_at(2)
    if composite:
        mngr = ocp.CheckpointManager(
            tmp_path, item_handlers={"model": oeqx.EqxHandler()}
        )
        mngr.save(7, args=ocp.args.Composite(model=oeqx.EqxSave(model)))
    else:
        mngr = _legacy_manager(tmp_path)
        mngr.save(7, args=oeqx.EqxSave(model))
    mngr.wait_until_finished()

    def flat_of(restored):
        return restored.model if composite else restored

    _check_flat(flat_of(mngr.restore(7)), model)
    mngr.close()

    # No handlers: Orbax finds ours by the typestr recorded in the checkpoint.
    assert oeqx.EqxHandler.typestr() == "orbax_eqx.EqxHandler"
    fresh = ocp.CheckpointManager(tmp_path)
    assert fresh.all_steps() == [7]
    _check_flat(flat_of(fresh.restore(7)), model)
    args = oeqx.EqxRestore(skeleton_mlp())
    restored = fresh.restore(
        7, args=ocp.args.Composite(model=args) if composite else args
    )
    assert_trees_equal(flat_of(restored), model)
    metadata = fresh.item_metadata(7)
    metadata = metadata.model if composite else metadata
    assert isinstance(metadata, oeqx.Metadata)
    assert set(metadata.leaves) == set(_expected_flat(model)) | {
        "activation",
        "final_activation",
    }
    fresh.close()


def test_item_metadata(tmp_path):
    model = _model_at(0)
    mngr = _legacy_manager(tmp_path)
    mngr.save(0, args=oeqx.EqxSave({"model": model, "step": 3, "lr": 1e-3}))
    mngr.wait_until_finished()

    metadata = mngr.item_metadata(0)
    assert isinstance(metadata, oeqx.Metadata)
    assert metadata.format_version == 7
    assert metadata.versions["orbax_eqx"] == oeqx.__version__
    weight = metadata.leaves["model.layers.0.weight"]
    assert (weight.kind, weight.shape, weight.dtype) == ("array", (8, 4), "float32")
    assert weight.path == "['model'].layers[0].weight"
    assert metadata.leaves["step"].kind == "scalar"
    assert metadata.leaves["step"].value == 3
    assert metadata.modules["model"].cls == "equinox.nn._mlp.MLP"
    assert metadata.modules["model"].static["width_size"] == 8
    assert metadata.nbytes == sum(
        x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    )
    # The same through the handler itself and the standalone API.
    item_dir = tmp_path / "0" / "default"
    assert oeqx.EqxHandler().metadata(item_dir) == metadata
    assert oeqx.metadata(tmp_path / "0").leaves == metadata.leaves
    mngr.close()


def test_model_with_optax_state_and_step(tmp_path):
    model = make_mlp(jax.random.key(0))
    optim = optax.adam(1e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((5, 4))

    @eqx.filter_jit
    def train_step(model, opt_state):
        def loss(model):
            return jnp.mean(jax.vmap(model)(x) ** 2)

        grads = eqx.filter_grad(loss)(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    for _ in range(3):
        model, opt_state = train_step(model, opt_state)
    item = {"model": model, "opt_state": opt_state, "step": 3}

    mngr = _legacy_manager(tmp_path)
    mngr.save(3, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()

    def make_item(key):
        m = make_mlp(key)
        return {
            "model": m,
            "opt_state": optim.init(eqx.filter(m, eqx.is_array)),
            "step": 0,
        }

    skeleton = eqx.filter_eval_shape(make_item, jax.random.key(99))
    restored = mngr.restore(3, args=oeqx.EqxRestore(skeleton))
    assert restored["step"] == 3
    assert int(restored["opt_state"][0].count) == 3
    assert_trees_equal(restored, item)
    # Training goes on from the restored state exactly as from the original.
    assert_trees_equal(
        train_step(restored["model"], restored["opt_state"]),
        train_step(model, opt_state),
    )
    mngr.close()


def test_batchnorm_model_and_state(tmp_path):
    make = eqx.nn.make_with_state(BatchNormNet)
    model, state = make(jax.random.key(0))
    batched = jax.vmap(
        lambda m, x, s: m(x, s),
        in_axes=(None, 0, None),
        out_axes=(0, None),
        axis_name="batch",
    )
    for i in range(3):  # move the running statistics away from their init
        x = jax.random.normal(jax.random.key(10 + i), (16, 3))
        _, state = batched(model, x, state)

    mngr = _legacy_manager(tmp_path)
    mngr.save(0, args=oeqx.EqxSave((model, state)))
    mngr.wait_until_finished()

    skeleton = eqx.filter_eval_shape(make, jax.random.key(5))
    restored_model, restored_state = mngr.restore(0, args=oeqx.EqxRestore(skeleton))
    assert_trees_equal((restored_model, restored_state), (model, state))

    x = jax.random.normal(jax.random.key(42), (8, 3))
    inference = eqx.nn.inference_mode(model)
    expected, _ = batched(inference, x, state)
    actual, _ = batched(eqx.nn.inference_mode(restored_model), x, restored_state)
    np.testing.assert_array_equal(actual, expected)
    # And the training-mode step (which reads and updates the state) too.
    assert_trees_equal(
        batched(restored_model, x, restored_state), batched(model, x, state)
    )
    mngr.close()


def test_inference_restore_from_training_checkpoint(tmp_path):
    # Two orbax_eqx items in one step: the training state and an EMA model.
    model = _model_at(0)
    optim = optax.adam(1e-3)
    train = {
        "model": model,
        "opt_state": optim.init(eqx.filter(model, eqx.is_array)),
        "step": 3,
    }
    handlers = {"train": oeqx.EqxHandler(), "ema": oeqx.EqxHandler()}
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=handlers)
    mngr.save(
        3,
        args=ocp.args.Composite(
            train=oeqx.EqxSave(train), ema=oeqx.EqxSave(scaled(model, 0.5))
        ),
    )
    mngr.wait_until_finished()

    # Only the model, in bfloat16: skip the optimizer state, cast the weights.
    bf16 = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        skeleton_mlp(),
    )
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `model\.layers\.0\.weight` has dtype bfloat16 in the "
        r"skeleton but float32 in the checkpoint.*"
        r"Leaf `opt_state\.0\.count` is "
        r"in the checkpoint but not in the skeleton",
    ):
        mngr.restore(3, args=ocp.args.Composite(train=oeqx.EqxRestore({"model": bf16})))
    restored = mngr.restore(
        3,
        args=ocp.args.Composite(
            train=oeqx.EqxRestore({"model": bf16}, strict=False, cast=True),
            ema=oeqx.EqxRestore(skeleton_mlp()),
        ),
    )
    assert_trees_equal(
        restored.train["model"],
        jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_array(x) else x, model),
    )
    assert_trees_equal(restored.ema, scaled(model, 0.5))
    mngr.close()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_ocdbt": False},
        {"use_zarr3": True},
        {"use_ocdbt": False, "use_zarr3": True},
        {"use_compression": False},
    ],
    ids=["ocdbt", "no-ocdbt", "zarr3", "zarr3-no-ocdbt", "no-compression"],
)
def test_handler_options_and_leaf_kinds(tmp_path, options, asynchronous):
    mngr = ocp.CheckpointManager(
        tmp_path,
        item_handlers=oeqx.EqxHandler(**options),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous),
    )
    item = {
        "model": _model_at(1),
        "host": np.arange(6.0).reshape(2, 3),
        "scalar": np.float32(2.5),
        "empty": jnp.zeros((0, 3)),
        "key": jax.random.key(3),
        "ints": jnp.arange(4, dtype=jnp.int8),
        "name": "run-1",
    }
    mngr.save(0, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    skeleton = {
        "model": skeleton_mlp(),
        "host": np.zeros((2, 3)),
        "scalar": np.float32(0),
        "empty": jax.ShapeDtypeStruct((0, 3), jnp.float32),
        "key": jax.eval_shape(lambda: jax.random.key(0)),
        "ints": jax.ShapeDtypeStruct((4,), jnp.int8),
        "name": "",
    }
    assert_trees_equal(mngr.restore(0, args=oeqx.EqxRestore(skeleton)), item)
    mngr.close()
    # A manager with a default handler reads whatever options wrote it.
    fresh = ocp.CheckpointManager(tmp_path)
    flat = fresh.restore(0)
    np.testing.assert_array_equal(flat["host"], item["host"])
    assert flat["name"] == "run-1"
    fresh.close()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_item_without_stored_arrays(tmp_path, asynchronous):
    # Only the sidecar is written: no array reaches Orbax's array store.
    mngr = ocp.CheckpointManager(
        tmp_path,
        item_handlers=oeqx.EqxHandler(),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous),
    )
    item = {
        "step": 3,
        "act": eqx.nn.Lambda(jax.nn.relu),
        "empty": jnp.zeros((0, 2)),
        "lr": float("inf"),
    }
    mngr.save(0, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0]
    skeleton = {
        "step": 0,
        "act": eqx.nn.Lambda(jax.nn.relu),
        "empty": jax.ShapeDtypeStruct((0, 2), jnp.float32),
        "lr": 0.0,
    }
    assert_trees_equal(mngr.restore(0, args=oeqx.EqxRestore(skeleton)), item)
    flat = mngr.restore(0)
    assert flat["step"] == 3 and flat["lr"] == float("inf")
    assert flat["empty"].shape == (0, 2)
    mngr.close()
