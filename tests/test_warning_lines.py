"""Warnings point at the user's line, not at orbax_eqx's or Orbax's frames.

`warnings.warn` names a file and line; a restore reaches our checks through
several frames of ours (and, under a `CheckpointManager`, of Orbax's), so a
fixed `stacklevel` named one of those instead of the caller.
"""

import sys
import warnings

import equinox as eqx
import jax
import orbax.checkpoint as ocp
import pytest
import zoo

import orbax_eqx as oeqx

KEY_SAVE = jax.random.key(0)
KEY_SKELETON = jax.random.key(1)


def _kept(tmp_path):
    """A checkpoint and a skeleton with one leaf more: `missing="keep"` warns."""
    saved = {"body": zoo.mlp(KEY_SAVE)}
    skeleton = {"body": zoo.skeleton(zoo.mlp, KEY_SKELETON), "scale": 0.5}
    return saved, skeleton, {"missing": "keep"}, oeqx.OrbaxEqxWarning


def _static(tmp_path):
    """A static field that differs: `on_static_mismatch="warn"` warns."""
    saved = zoo.Block(KEY_SAVE, num_heads=2)
    skeleton = eqx.filter_eval_shape(zoo.Block, KEY_SKELETON, num_heads=4)
    return saved, skeleton, {"on_static_mismatch": "warn"}, oeqx.StaticMismatchWarning


CASES = [_kept, _static]


def _one(caught, category):
    (warning,) = [w for w in caught if issubclass(w.category, category)]
    return warning


@pytest.mark.parametrize("case", CASES, ids=["kept-leaves", "static-mismatch"])
def test_restore_warns_at_the_callers_line(tmp_path, case):
    saved, skeleton, options, category = case(tmp_path)
    oeqx.save(tmp_path / "ckpt", saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after()
        oeqx.restore(tmp_path / "ckpt", skeleton, **options)
    warning = _one(caught, category)
    assert warning.filename == __file__
    assert warning.lineno == line


@pytest.mark.parametrize("case", CASES, ids=["kept-leaves", "static-mismatch"])
def test_manager_restore_warns_at_the_callers_line(tmp_path, case):
    saved, skeleton, options, category = case(tmp_path)
    mngr = ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler())
    mngr.save(0, args=oeqx.EqxSave(saved))
    mngr.wait_until_finished()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after()
        mngr.restore(0, args=oeqx.EqxRestore(skeleton, **options))
    mngr.close()
    warning = _one(caught, category)
    assert warning.filename == __file__
    assert warning.lineno == line


def test_restore_latest_warns_at_the_callers_line(tmp_path):
    saved, skeleton, options, category = _kept(tmp_path)
    mngr = ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler())
    mngr.save(0, args=oeqx.EqxSave(saved))
    mngr.wait_until_finished()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after()
        oeqx.restore_latest(mngr, oeqx.EqxRestore(skeleton, **options))
    mngr.close()
    warning = _one(caught, category)
    assert warning.filename == __file__
    assert warning.lineno == line


def _line_after() -> int:
    """The number of the line after the caller's."""
    return sys._getframe(1).f_lineno + 1
