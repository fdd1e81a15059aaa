"""Python values in the sidecar: exact for scalars, descriptive for the rest.

Internal modules imported here (`_tree.values`) are the units these tests pin,
or the only way to cause or observe the condition under test; everything else
goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import enum
import functools
import json
import math

import jax
import numpy as np
import pytest

from orbax_eqx._tree.values import (
    clean_repr,
    decode_scalar,
    describe,
    describe_callable,
    encode,
    scalar_type,
)


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
def test_scalars_roundtrip_exactly_through_json(value):
    decoded = decode_scalar(json.loads(json.dumps(encode(value))))
    assert type(decoded) is type(value)
    assert repr(decoded) == repr(value)


def test_nan_roundtrips():
    assert math.isnan(decode_scalar(json.loads(json.dumps(encode(math.nan)))))


def test_bool_is_not_int_and_int_is_not_float():
    assert scalar_type(encode(True)) == "bool"
    assert scalar_type(encode(1)) == "int"
    assert scalar_type(encode(1.0)) == "float"


class Color(enum.Enum):
    RED = 1


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
def test_descriptions(value, text):
    assert describe(encode(value)) == text


def test_custom_jvp_functions_are_named_by_where_jax_defines_them():
    # `jax.nn.relu` is a `custom_jvp` object, not a function; its name comes
    # from the wrapped function. Where JAX defines it is JAX's own business
    # (`jax._src.nn.functions` today), so the expected text is derived.
    text = describe(json.loads(json.dumps(encode(jax.nn.relu))))
    assert text == f"{jax.nn.relu.__module__}.{jax.nn.relu.__qualname__}"
    assert text.startswith("jax.") and text.endswith(".relu")
    assert text != describe(encode(jax.nn.gelu))


def test_object_descriptions_drop_addresses():
    class Thing:
        pass

    thing = Thing()
    assert " at 0x" in repr(object.__repr__(thing))
    assert " at 0x" not in clean_repr(thing)
    assert encode(thing) == encode(Thing())


def test_lambdas_are_named_by_where_they_are_defined():
    assert describe_callable(lambda x: x).endswith("<locals>.<lambda>")


def test_decode_refuses_non_scalars():
    with pytest.raises(ValueError, match="not an encoded Python scalar"):
        decode_scalar({"callable": "os.system"})
