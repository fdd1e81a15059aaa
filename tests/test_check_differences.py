"""The restore check collects typed differences first, then words them once.

`compare` returns one `Difference` per difference (its kind, whether it is
static, the fixes that mend it); `judge` words them all, with no side effect.
Each case here saves a real checkpoint, reads its real sidecar, and checks
both the collected differences and that the public restore says each one.
"""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import orbax_eqx as oeqx
from orbax_eqx._restore import check
from orbax_eqx._restore.check import StaticMismatchWarning, compare
from orbax_eqx._tree.walk import walk


class Net(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    width: int = eqx.field(static=True)
    name: str


class Wider(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    width: int = eqx.field(static=True)
    name: str


def _net(width=4, name="a", dtype=jnp.float32):
    return Net(jnp.ones((width, 3), dtype), jnp.zeros((width,)), width, name)


def _compare(tmp_path, skeleton, *, strict=True, missing="error", cast=False):
    saved = oeqx.metadata(tmp_path / "ckpt")
    return compare(
        walk(skeleton),
        saved,
        cast=cast,
        strict=strict,
        missing=missing,
        target=None,
    )


def _summary(differences):
    return [(d.kind, d.static, d.fixes, d.text) for d in differences]


def _restore_message(tmp_path, skeleton, **kwargs) -> str:
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton, **kwargs)
    return str(info.value)


def test_shape_and_static_field_are_two_typed_differences(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net(width=4))
    skeleton = eqx.filter_eval_shape(lambda: _net(width=5))
    differences, kept = _compare(tmp_path, skeleton)
    assert kept == []
    kinds = [(d.kind, d.static, d.fixes) for d in differences]
    assert kinds == [
        ("differs", False, (check.FIX_INSPECT,)),
        ("differs", False, (check.FIX_INSPECT,)),
        ("differs", True, (check.FIX_INSPECT,)),
    ]
    assert differences[0].text.startswith("Leaf `weight` has shape (5, 3)")
    assert differences[1].text.startswith("Leaf `bias` has shape (5,)")
    assert differences[2].text == (
        "Static field `width` of module `<root>` is 5 in the skeleton but 4 in "
        "the checkpoint."
    )
    # The public restore says every collected difference, in one message.
    message = _restore_message(tmp_path, skeleton)
    assert "(3 differences)" in message
    for d in differences:
        assert d.text in message


def test_absent_and_unexpected_leaves_are_typed_and_keep_is_applied(tmp_path):
    # Dicts: no module class that could differ too.
    oeqx.save(tmp_path / "ckpt", {"weight": jnp.ones(3), "extra": jnp.ones(2)})
    skeleton = {"weight": jnp.ones(3), "head": jnp.zeros(4)}
    differences, kept = _compare(tmp_path, skeleton)
    assert [(d.kind, d.fixes) for d in differences] == [
        ("absent", (check.FIX_MISSING,)),
        ("unexpected", (check.FIX_STRICT,)),
    ]
    assert differences[0].text == (
        "Leaf `head` is in the skeleton but not in the checkpoint."
    )
    assert differences[1].text == (
        "Leaf `extra` is in the checkpoint but not in the skeleton."
    )
    assert kept == []

    # `missing="keep"` keeps the concrete leaf: it is no difference any more.
    differences, kept = _compare(tmp_path, skeleton, missing="keep")
    assert [d.kind for d in differences] == ["unexpected"]
    assert [leaf.name for leaf in kept] == ["head"]
    # `strict=False` collects no unexpected leaf; the restore then succeeds.
    differences, kept = _compare(tmp_path, skeleton, missing="keep", strict=False)
    assert differences == []
    with pytest.warns(oeqx.OrbaxEqxWarning, match="`head`"):
        restored = oeqx.restore(
            tmp_path / "ckpt", skeleton, missing="keep", strict=False
        )
    assert bool((restored["head"] == 0).all())

    # An abstract leaf cannot be kept: a difference of its own, with its fix.
    abstract = eqx.filter_eval_shape(lambda: skeleton)
    differences, kept = _compare(tmp_path, abstract, missing="keep", strict=False)
    assert [(d.kind, d.fixes) for d in differences] == [
        ("differs", (check.FIX_ABSTRACT,))
    ]
    assert kept == []
    message = _restore_message(tmp_path, abstract, missing="keep", strict=False)
    assert differences[0].text in message
    assert check.FIX_ABSTRACT in message


def test_class_difference_is_static_and_warn_lets_it_pass(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net())
    skeleton = Wider(jnp.ones((4, 3)), jnp.zeros((4,)), 4, "a")
    differences, _ = _compare(tmp_path, skeleton)
    assert [(d.kind, d.static, d.fixes) for d in differences] == [("differs", True, ())]
    assert re.match(
        r"Module `<root>` is `.*Wider` in the skeleton but `.*Net`", differences[0].text
    )

    # Worded once, purely: the same differences give the same verdict.
    where = str(tmp_path / "ckpt")
    refused = check.judge(differences, where, "error")
    assert refused == check.judge(differences, where, "error")
    assert refused.warning is None
    assert refused.error is not None and check.FIX_STATIC in refused.error
    allowed = check.judge(differences, where, "warn")
    assert allowed.error is None
    assert allowed.warning is not None and "restoring anyway" in allowed.warning

    assert differences[0].text in _restore_message(tmp_path, skeleton)
    with pytest.warns(StaticMismatchWarning, match="restoring anyway"):
        restored = oeqx.restore(tmp_path / "ckpt", skeleton, on_static_mismatch="warn")
    assert type(restored) is Wider


def test_python_value_of_another_type_and_a_dtype_are_typed(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net())
    skeleton = Net(jnp.ones((4, 3), jnp.int32), jnp.zeros((4,)), 4, 7)
    differences, _ = _compare(tmp_path, skeleton)
    assert [(d.kind, d.static, d.fixes) for d in differences] == [
        ("differs", False, (check.FIX_CAST,)),
        ("differs", False, (check.FIX_KIND,)),
    ]
    assert differences[1].text == (
        "Leaf `name` is a Python int in the skeleton but a Python str in the "
        "checkpoint."
    )
    # With `cast=True` the dtype is no difference.
    differences, _ = _compare(tmp_path, skeleton, cast=True)
    assert [d.fixes for d in differences] == [(check.FIX_KIND,)]


def test_no_difference_collects_nothing_and_restores(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net())
    skeleton = eqx.filter_eval_shape(_net)
    assert _compare(tmp_path, skeleton) == ([], [])
    assert check.judge([], "x", "error") == check.Verdict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    assert restored.name == "a"
