"""Python values in the sidecar: exact for scalars, descriptive for the rest,
as a save records them and a restore, `metadata` or a warning reads them."""

import enum
import functools
import math
import re
import warnings

import equinox as eqx
import jax
import numpy as np
import pytest
import sidecars

import orbax_eqx as oeqx


def _round_trip(tmp_path, value):
    """`value` saved as a leaf, restored without a skeleton: from disk alone."""
    oeqx.save(tmp_path / "ckpt", {"v": value})
    return oeqx.restore(tmp_path / "ckpt")["v"]


@pytest.mark.parametrize(
    "value",
    [
        0,
        -1,
        2**63,
        -(2**100),
        0.1,
        -0.0,
        math.inf,
        -math.inf,
        1e-310,
        True,
        False,
        "",
        "héllo\n\x00",
        None,
        1 + 2j,
        complex(-0.0, math.inf),
        b"\x00\xff",
    ],
)
def test_scalars_roundtrip_exactly_through_json(tmp_path, value):
    decoded = _round_trip(tmp_path, value)
    assert type(decoded) is type(value)
    assert repr(decoded) == repr(value)


def test_nan_roundtrips(tmp_path):
    assert math.isnan(_round_trip(tmp_path, math.nan))


def test_bool_is_not_int_and_int_is_not_float(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"b": True, "i": 1, "f": 1.0})
    restored = oeqx.restore(tmp_path / "ckpt")
    assert [type(restored[k]) for k in "bif"] == [bool, int, float]
    leaves = oeqx.metadata(tmp_path / "ckpt").leaves
    assert [leaves[k].describe() for k in "bif"] == ["bool True", "int 1", "float 1.0"]


class Color(enum.Enum):
    RED = 1


class Static(eqx.Module):
    w: np.ndarray
    value: object = eqx.field(static=True)


@pytest.mark.parametrize(
    "value, text",
    [
        ((1, "a"), "(1, 'a')"),
        ((1,), "(1,)"),
        ([1.5], "[1.5]"),
        ({"k": (2, 3)}, "{'k': (2, 3)}"),
        (np.dtype("float32"), "dtype('float32')"),
        (np.float32(2), "float32(2.0)"),
        (Color.RED, "test_values.Color.RED"),
        (functools.partial(max, 3), "functools.partial(builtins.max, 3)"),
        (int, "builtins.int"),
    ],
    ids=[
        "tuple",
        "one_tuple",
        "list",
        "dict",
        "dtype",
        "np_scalar",
        "enum",
        "partial",
        "class",
    ],
)
def test_descriptions(tmp_path, value, text):
    # A static field's value, as a restore into another one describes it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # equinox on a static array-like
        oeqx.save(tmp_path / "ckpt", Static(np.zeros(1), value))
    with pytest.warns(
        oeqx.StaticMismatchWarning,
        match=rf"Static field `value` of module `<root>` is 5 in the skeleton but "
        rf"{re.escape(text)} in the checkpoint\.$",
    ):
        oeqx.restore(
            tmp_path / "ckpt", Static(np.zeros(1), 5), on_static_mismatch="warn"
        )


def test_custom_jvp_functions_are_named_by_where_jax_defines_them(tmp_path):
    # `jax.nn.relu` is a `custom_jvp` object, not a function; its name comes
    # from the wrapped function. Where JAX defines it is JAX's own business
    # (`jax._src.nn.functions` today), so the expected text is derived.
    oeqx.save(tmp_path / "ckpt", {"relu": jax.nn.relu, "gelu": jax.nn.gelu})
    restored = oeqx.restore(tmp_path / "ckpt")
    text = restored["relu"].description
    assert restored["relu"] == oeqx.RecordedLeaf("callable", text)
    assert text == f"{jax.nn.relu.__module__}.{jax.nn.relu.__qualname__}"
    assert text.startswith("jax.") and text.endswith(".relu")
    assert text != restored["gelu"].description


def test_object_descriptions_drop_addresses(tmp_path):
    class Thing:
        pass

    thing = Thing()
    assert " at 0x" in repr(object.__repr__(thing))
    oeqx.save(tmp_path / "a", {"x": thing})
    oeqx.save(tmp_path / "b", {"x": Thing()})
    (a,), (b,) = (oeqx.metadata(tmp_path / d).leaves.values() for d in "ab")
    assert a.kind == "object" and " at 0x" not in a.describe()
    assert a.value == b.value


def test_lambdas_are_named_by_where_they_are_defined(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"f": lambda x: x})
    (leaf,) = oeqx.metadata(tmp_path / "ckpt").leaves.values()
    assert leaf.describe().endswith("<locals>.<lambda>")


def test_decode_refuses_non_scalars(tmp_path):
    # A scalar record whose value is a description: damage, never imported.
    oeqx.save(tmp_path / "ckpt", {"v": 1})
    sidecars.edit(
        tmp_path / "ckpt",
        lambda c: c["leaves"]["v"].update(value={"callable": "os.system"}),
    )
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"is damaged: leaf 'v' has no valid Python value\. Restore an earlier "
        r"step, or re-save the checkpoint\.$",
    ):
        oeqx.restore(tmp_path / "ckpt")
