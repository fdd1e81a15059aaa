"""A restore into a skeleton that differs says every difference, typed, in
one message, each followed once by the fixes that mend it; `warn` lets
static differences pass, and the same differences are worded the same.

Each case saves a real checkpoint and restores it into a skeleton that
differs from it in one or more ways.
"""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import orbax_eqx as oeqx

FIX_INSPECT = (
    "If you changed hyperparameters, rebuild the skeleton with the saved ones "
    "(see `python -m orbax_eqx inspect {where}`)."
)
FIX_ABSTRACT = (
    "A leaf kept from the skeleton needs a value: build those parts of the "
    "skeleton as concrete arrays (e.g. with a real key instead of "
    "`eqx.filter_eval_shape`), or map a checkpoint leaf to them with `renames=`."
)
FIX_CAST = "To cast arrays to the skeleton's dtypes, pass `EqxRestore(..., cast=True)`."
FIX_KIND = (
    "Give each such skeleton leaf the kind the checkpoint holds there: a Python "
    "value of the saved type for a Python value (any value: the saved one is "
    "restored), an array of the saved shape and dtype for an array (see "
    "`python -m orbax_eqx inspect {where}`)."
)
FIX_MISSING = (
    "The skeleton has leaves that the checkpoint never saved: build the skeleton "
    "of the model that was saved, map renamed leaves with `renames=`, or, to keep "
    "the skeleton's own values for new leaves (a fresh head for fine-tuning), "
    'pass `EqxRestore(..., missing="keep")`.'
)
FIX_STATIC = (
    "To restore into the skeleton as it is (the same class under another module "
    "name, a deliberate change of a static field or callable), pass "
    '`EqxRestore(..., on_static_mismatch="warn")`: the skeleton\'s classes, static '
    "fields and callables are kept."
)
FIX_STRICT = (
    "To leave out checkpoint leaves that the skeleton lacks, pass "
    "`EqxRestore(..., strict=False)`; to restore one part of the checkpoint, give "
    "a skeleton of that part and its leaf name as `prefix=` (e.g. "
    '`prefix="model.encoder"`).'
)


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


def _said(tmp_path, skeleton, **kwargs) -> tuple[list[str], list[str]]:
    """The differences a refused restore lists, and the lines after them."""
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(tmp_path / "ckpt", skeleton, **kwargs)
    head, *lines = str(info.value).splitlines()
    where = re.escape(str(tmp_path / "ckpt"))
    n = len([line for line in lines if line.startswith("  - ")])
    assert re.fullmatch(
        rf"The skeleton does not match the checkpoint at {where} "
        rf"\({n} difference{'s' if n > 1 else ''}\):",
        head,
    ), head
    return [line[4:] for line in lines[:n]], lines[n:]


def _fixes(tmp_path, *fixes):
    return [fix.format(where=tmp_path / "ckpt") for fix in fixes]


def test_shape_and_static_field_are_two_typed_differences(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net(width=4))
    skeleton = eqx.filter_eval_shape(lambda: _net(width=5))
    differences, fixes = _said(tmp_path, skeleton)
    assert len(differences) == 3
    assert differences[0].startswith("Leaf `weight` has shape (5, 3)")
    assert differences[1].startswith("Leaf `bias` has shape (5,)")
    assert differences[2] == (
        "Static field `width` of module `<root>` is 5 in the skeleton but 4 in "
        "the checkpoint."
    )
    # One fix for all three, said once.
    assert fixes == _fixes(tmp_path, FIX_INSPECT)


def test_absent_and_unexpected_leaves_are_typed_and_keep_is_applied(tmp_path):
    # Dicts: no module class that could differ too.
    oeqx.save(tmp_path / "ckpt", {"weight": jnp.ones(3), "extra": jnp.ones(2)})
    skeleton = {"weight": jnp.ones(3), "head": jnp.zeros(4)}
    differences, fixes = _said(tmp_path, skeleton)
    assert differences == [
        "Leaf `head` is in the skeleton but not in the checkpoint.",
        "Leaf `extra` is in the checkpoint but not in the skeleton.",
    ]
    assert fixes == [FIX_MISSING, FIX_STRICT]

    # `missing="keep"` keeps the concrete leaf: it is no difference any more.
    differences, fixes = _said(tmp_path, skeleton, missing="keep")
    assert differences == ["Leaf `extra` is in the checkpoint but not in the skeleton."]
    assert fixes == [FIX_STRICT]
    # `strict=False` collects no unexpected leaf; the restore then succeeds.
    with pytest.warns(oeqx.OrbaxEqxWarning, match="`head`"):
        restored = oeqx.restore(
            tmp_path / "ckpt", skeleton, missing="keep", strict=False
        )
    assert bool((restored["head"] == 0).all())

    # An abstract leaf cannot be kept: a difference of its own, with its fix.
    abstract = eqx.filter_eval_shape(lambda: skeleton)
    differences, fixes = _said(tmp_path, abstract, missing="keep", strict=False)
    assert len(differences) == 1 and "`head`" in differences[0]
    assert fixes == [FIX_ABSTRACT]


def test_class_difference_is_static_and_warn_lets_it_pass(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net())
    skeleton = Wider(jnp.ones((4, 3)), jnp.zeros((4,)), 4, "a")
    with pytest.raises(oeqx.CheckpointMismatchError) as first:
        oeqx.restore(tmp_path / "ckpt", skeleton)
    differences, fixes = _said(tmp_path, skeleton)
    assert len(differences) == 1
    assert re.match(
        r"Module `<root>` is `.*Wider` in the skeleton but `.*Net`", differences[0]
    )
    assert fixes == [FIX_STATIC]  # static: no fix of its own but `warn`
    # Worded once, purely: the same differences give the same message.
    assert str(first.value).splitlines()[1:] == [f"  - {differences[0]}", *fixes]

    with pytest.warns(oeqx.StaticMismatchWarning, match="restoring anyway") as said:
        restored = oeqx.restore(tmp_path / "ckpt", skeleton, on_static_mismatch="warn")
    assert type(restored) is Wider
    (warning,) = said
    assert differences[0] in str(warning.message)
    assert FIX_STATIC not in str(warning.message)


def test_python_value_of_another_type_and_a_dtype_are_typed(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net())
    skeleton = Net(jnp.ones((4, 3), jnp.int32), jnp.zeros((4,)), 4, 7)
    differences, fixes = _said(tmp_path, skeleton)
    assert len(differences) == 2 and "`weight`" in differences[0]
    assert differences[1] == (
        "Leaf `name` is a Python int in the skeleton but a Python str in the "
        "checkpoint."
    )
    assert fixes == _fixes(tmp_path, FIX_CAST, FIX_KIND)
    # With `cast=True` the dtype is no difference.
    differences, fixes = _said(tmp_path, skeleton, cast=True)
    assert len(differences) == 1 and "`name`" in differences[0]
    assert fixes == _fixes(tmp_path, FIX_KIND)


def test_no_difference_collects_nothing_and_restores(tmp_path):
    oeqx.save(tmp_path / "ckpt", _net())
    skeleton = eqx.filter_eval_shape(_net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    assert restored.name == "a"
