"""Restore what you need, through a real `ocp.CheckpointManager`: subtrees,
`prefix=`, `renames=` and `missing="keep"` with a report, as `EqxRestore`
options, alone and inside a Composite."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx

from . import _procs
from ._models import assert_trees_equal, make_mlp, scaled, skeleton_mlp


def _train_state(step: int) -> dict:
    model = scaled(make_mlp(jax.random.key(0)), step + 1.0)
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": step}


@pytest.mark.parametrize("composite", [False, True], ids=["one-item", "composite"])
def test_partial_restores_through_the_manager(tmp_path, composite):
    if composite:
        mngr = ocp.CheckpointManager(
            tmp_path, item_handlers={"state": oeqx.EqxHandler()}
        )
    else:
        mngr = ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler())

    def wrap(args):
        return ocp.args.Composite(state=args) if composite else args

    def unwrap(restored):
        return restored.state if composite else restored

    for step in range(2):
        mngr.save(step, args=wrap(oeqx.EqxSave(_train_state(step))))  # async
    mngr.wait_until_finished()
    saved = _train_state(1)

    def restore(skeleton, **options):
        return unwrap(mngr.restore(1, args=wrap(oeqx.EqxRestore(skeleton, **options))))

    # The model alone, from the whole training state.
    only_model = restore({"model": skeleton_mlp()}, strict=False)
    assert_trees_equal(only_model, {"model": saved["model"]})
    # With strict=True, the rest of the state is an error naming the options.
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `step` is in the checkpoint but "
        r"not in the skeleton\..*strict=False.*prefix=",
    ):
        restore({"model": skeleton_mlp()})
    # One layer, through a prefix.
    layer = restore(skeleton_mlp().layers[1], prefix="model.layers.1")
    assert_trees_equal(layer, saved["model"].layers[1])
    # Renamed, with a new head kept from a live skeleton, and a report.
    fresh_head = eqx.nn.Linear(8, 5, key=jax.random.key(9))
    skeleton = {"net": skeleton_mlp(), "head": fresh_head}
    renames = (  # the skeleton's names to the checkpoint's; the rest left unread
        oeqx.StateDictMapping()
        .rename_regex(r"net\.(.*)", r"model.\1")
        .ignore(["opt_state.**", "step"])
    )
    tree, report = restore(skeleton, renames=renames, missing="keep", report=True)
    assert_trees_equal(tree["net"], saved["model"])
    assert tree["head"].weight is fresh_head.weight
    assert report.kept == ("head.weight", "head.bias")
    left_out = tuple(n for n, new in report.renamed.items() if new is None)
    assert "step" in left_out and report.unread == left_out
    assert report.renamed["model.layers.0.weight"] == "net.layers.0.weight"
    mngr.close()


def test_kept_leaves_warn_through_the_manager(tmp_path):
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler())
    mngr.save(0, args=oeqx.EqxSave({"body": make_mlp(jax.random.key(0))}))
    mngr.wait_until_finished()
    skeleton = {"body": skeleton_mlp(), "scale": jnp.ones(3)}
    with pytest.warns(oeqx.OrbaxEqxWarning, match=r"- `scale`"):
        restored = mngr.restore(0, args=oeqx.EqxRestore(skeleton, missing="keep"))
    assert_trees_equal(restored["body"], make_mlp(jax.random.key(0)))
    mngr.close()


def test_kept_arrays_go_where_shardings_say(tmp_path):
    (log,) = _procs.run(
        "_partial_worker.py", "keep", tmp_path, devices=8, log_dir=tmp_path
    )
    assert "kept arrays follow shardings: ok" in log
