"""A save of a tree structure saved before returns sooner: it takes the
arrays' bytes and checks the leaves' values, and names the leaves in the
background (see `_save/prepare.py`). These tests hold it to what a first save
does: the same refusals before anything is written, the same names, and what
the item was when `save` returned, whatever the caller does next.

Internal modules imported here (`_format.sidecar_read`, `_save.prepare`) are
the units these tests pin, or the only way to cause or observe the condition
under test; everything else goes through `orbax_eqx` and the `orbax-eqx`
command.
"""

import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_eqx as oeqx
from orbax_eqx._format.sidecar_read import read

NOT_UTF8 = os.fsdecode(b"caf\xe9")  # 'caf\udce9'


def _manager(path):
    return ocp.CheckpointManager(path, item_handlers=oeqx.EqxHandler())


def _slow_step_metadata(monkeypatch, tmp_path, delay_s=0.5):
    """Orbax writes a step's `_CHECKPOINT_METADATA` in a thread of its own,
    after its directory is made: made slow here, as on a loaded machine (the
    race a refused save once lost, removing the directory first)."""
    cls = type(epath.Path(tmp_path))
    write_text = cls.write_text

    def slow(self, *args, **kwargs):
        if self.name == "_CHECKPOINT_METADATA":
            time.sleep(delay_s)
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(cls, "write_text", slow)


@pytest.mark.slow
def test_text_that_is_not_unicode_is_refused_on_a_repeated_save(tmp_path, monkeypatch):
    item = {"name": "ok", "w": jnp.arange(4.0)}
    mngr = _manager(tmp_path)
    mngr.save(0, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    _slow_step_metadata(monkeypatch, tmp_path)
    bad = {"name": NOT_UTF8, "w": jnp.arange(4.0)}  # an equal structure
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=r"Leaf `name` is a str that is not valid Unicode: 'caf\\udce9'",
    ):
        mngr.save(1, args=oeqx.EqxSave(bad))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0]
    restored = mngr.restore(0, args=oeqx.EqxRestore(item))
    mngr.save(2, args=oeqx.EqxSave(item))  # the manager goes on as before
    mngr.wait_until_finished()
    mngr.close()
    assert restored["name"] == "ok"
    # Nothing of the refused save is left: no step, no temporary directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "2"]


def test_a_skeleton_is_refused_on_a_repeated_save(tmp_path):
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    oeqx.save(tmp_path / "a", model)
    skeleton = eqx.filter_eval_shape(lambda: model)
    with pytest.raises(oeqx.UnsupportedLeafError, match="jax.ShapeDtypeStruct"):
        oeqx.save(tmp_path / "b", skeleton)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("key", [True, 1, 1.0])
def test_keys_that_compare_equal_keep_their_own_names(tmp_path, key):
    # {True: x}, {1: x} and {1.0: x} have equal treedefs, but each is stored
    # under its own name, as a first save would name it.
    x = jnp.arange(3.0)
    for earlier in (True, 1, 1.0):
        if type(earlier) is not type(key):
            oeqx.save(tmp_path / f"before-{earlier!r}", {earlier: x})
    oeqx.save(tmp_path / "ckpt", {key: x})
    expected = {bool: "\\(True)", int: "1", float: "\\(1\\.0)"}[type(key)]
    assert list(read(tmp_path / "ckpt").leaves) == [expected]
    restored = oeqx.restore(
        tmp_path / "ckpt", {key: jax.ShapeDtypeStruct((3,), x.dtype)}
    )
    assert type(next(iter(restored))) is type(key)
    np.testing.assert_array_equal(restored[key], x)


def test_what_is_saved_is_the_item_as_save_returned(tmp_path):
    # The names are made in the background from a snapshot of the item's
    # structure: changing its dicts and lists, and donating its arrays, after
    # `save` returns changes nothing of the checkpoint.
    def item():
        return {"layers": [jnp.full((8,), float(i)) for i in range(4)], "step": 3}

    mngr = _manager(tmp_path)
    mngr.save(0, args=oeqx.EqxSave(item()))
    mngr.wait_until_finished()
    live = item()
    mngr.save(1, args=oeqx.EqxSave(live))
    live["layers"].append(jnp.zeros(8))
    live["layers"][0] = jnp.full((8,), -1.0)
    live["step"] = 4
    live["extra"] = jnp.ones(2)
    clobber = jax.jit(lambda x: x * 0 - 5, donate_argnums=0)
    jax.block_until_ready([clobber(x) for x in live["layers"][1:4]])
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=oeqx.EqxRestore(item()))
    mngr.close()
    assert eqx.tree_equal(restored, item())


def test_arrays_donated_before_the_background_walk_still_save():
    """A repeated save walks the item in its background thread, after `save`
    returned: the caller may have donated the arrays by then (their bytes
    were taken before it returned). Ordered by hand here: the walk's own
    check must not call them deleted."""
    from orbax_eqx._save.prepare import prepare

    item = {"w": jnp.arange(6.0) + 1, "b": [jnp.ones(3) * 2, jnp.zeros(2)]}
    expected = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), item)
    prepare(item, token="0" * 16).finish()  # a first save: the structure is known
    prepared = prepare(item, token="1" * 16)  # a repeated one: no walk yet
    for x in jax.tree_util.tree_leaves(item):
        x.delete()  # as donating it would
    prepared.finish()  # the background's part: walk, names, host copies
    assert prepared.packed_names == ["b.0", "b.1", "w"]
    for (_, host), x in zip(
        prepared.pieces, jax.tree_util.tree_leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(host, x)
