"""A step saved by a manager remembers its step directory and item: a step
copied over another, or items swapped, is said so when restored."""

import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx


def _item(n):
    return {"w": jnp.full((3,), float(n)), "b": np.full((2,), n, dtype=np.int32)}


def _skeleton():
    return _item(0)


def _manager(root):
    return ocp.CheckpointManager(
        root, item_handlers={"model": oeqx.EqxHandler(), "opt": oeqx.EqxHandler()}
    )


def _saved(root):
    with _manager(root) as m:
        for step in (1, 2):
            m.save(
                step,
                args=ocp.args.Composite(
                    model=oeqx.EqxSave(_item(step)), opt=oeqx.EqxSave(_item(10 + step))
                ),
            )
        m.wait_until_finished()
    return root


def _restore(path, **options):
    return oeqx.restore(path, _skeleton(), **options)


def test_an_ordinary_manager_save_restores_without_warning(tmp_path):
    root = _saved(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _manager(root) as m:
            got = m.restore(
                2,
                args=ocp.args.Composite(
                    model=oeqx.EqxRestore(_skeleton()), opt=oeqx.EqxRestore(_skeleton())
                ),
            )
        assert float(got["model"]["w"][0]) == 2 and float(got["opt"]["w"][0]) == 12
        assert oeqx.metadata(root / "2" / "model").saved_as == ("2", "model")


def test_a_step_copied_over_another_is_said_so(tmp_path):
    root = _saved(tmp_path / "run")
    shutil.rmtree(root / "2")
    shutil.copytree(root / "1", root / "2")
    message = (
        r"The checkpoint at \S+/2/model was saved as step 1, item 'model', but is "
        r"restored from step 2, item 'model': the step directory was copied or "
        r"renamed, or items swapped\. If it was moved on purpose, pass "
        r'`on_moved="ignore"`'
    )
    with pytest.warns(oeqx.OrbaxEqxWarning, match=message):
        got = _restore(root / "2" / "model")
    assert float(got["w"][0]) == 1


def test_swapped_items_are_said_so_naming_both(tmp_path):
    root = _saved(tmp_path / "run")
    step = root / "2"
    (step / "model").rename(step / "swap")
    (step / "opt").rename(step / "model")
    (step / "swap").rename(step / "opt")
    with pytest.warns(
        oeqx.OrbaxEqxWarning,
        match=r"saved as step 2, item 'opt', but is restored from step 2, "
        r"item 'model'",
    ):
        _restore(step / "model")
    with pytest.warns(
        oeqx.OrbaxEqxWarning,
        match=r"saved as step 2, item 'model', but is restored from step 2, "
        r"item 'opt'",
    ):
        _restore(step / "opt")


def test_on_moved_error_raises_and_ignore_is_quiet(tmp_path):
    root = _saved(tmp_path / "run")
    shutil.rmtree(root / "2")
    shutil.copytree(root / "1", root / "2")
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"saved as step 1, item 'opt', but is restored from step 2, item "
        r"'opt': .* Restore the step and item it was saved as, or pass "
        r'`on_moved="warn"` to restore it from here anyway\.',
    ):
        _restore(root / "2" / "opt", on_moved="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(_restore(root / "2" / "opt", on_moved="ignore")["w"][0]) == 11
    with pytest.raises(ValueError, match=r'on_moved=\'fail\'\): expected "warn"'):
        oeqx.EqxRestore(_skeleton(), on_moved="fail")


def test_a_standalone_save_moved_anywhere_restores_quietly(tmp_path):
    oeqx.save(tmp_path / "a" / "model", _item(5))
    assert oeqx.metadata(tmp_path / "a" / "model").saved_as is None
    (tmp_path / "b").mkdir()
    shutil.move(tmp_path / "a" / "model", tmp_path / "b" / "opt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(_restore(tmp_path / "b" / "opt")["w"][0]) == 5
