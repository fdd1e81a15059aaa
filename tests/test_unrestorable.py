"""Nothing is saved that cannot be restored as it was.

Structured and object dtypes, subclasses of `np.ndarray` that a restore would
turn into plain arrays, and (with `pack=False`) dtypes that Orbax's array
store cannot hold are refused when the save starts, listing every such leaf,
with nothing written. Bool arrays whose bytes are not 0/1 restore.
"""

import os
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx

_STRUCTURED = [
    np.zeros(3, [("a", "<i4"), ("b", "<f4")]),
    np.zeros(2, [("a", [("x", "<i2")]), ("b", "<f8")]),
    np.zeros(2, np.dtype([("a", "i1"), ("b", "<f8")], align=True)),
    np.zeros(2, [("a", ">i4")]),
    np.zeros(1, [("a", "<i4")])[0],  # a numpy scalar of it
]


def _nothing_left(tmp_path):
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "orbax"])
@pytest.mark.parametrize(
    "value", _STRUCTURED, ids=["plain", "nested", "aligned", "big-endian", "scalar"]
)
def test_structured_dtypes_are_refused(tmp_path, value, pack):
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=r"(?s)Cannot save this item: these arrays would not restore as they "
        r"are \(nothing was written\):\n  - Leaf `\['data'\]` is an array of "
        r"structured dtype .*'a'.*which orbax_eqx cannot record so that it "
        r"reads back\.\nSave each field of a structured array as its own leaf",
    ):
        oeqx.save(tmp_path / "ckpt", {"data": value, "w": np.ones(2)}, pack=pack)
    _nothing_left(tmp_path)


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "orbax"])
def test_object_arrays_are_refused(tmp_path, pack):
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=r"Leaf `\['data'\]` is an array of dtype object, whose elements are "
        r"Python objects, not data\.\nConvert an object array to a numeric dtype",
    ):
        oeqx.save(tmp_path / "ckpt", {"data": np.array([1, "a"], object)}, pack=pack)
    _nothing_left(tmp_path)


class _Tagged(np.ndarray):
    pass


def _matrix():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.matrix([[1, 2]])


@pytest.mark.parametrize(
    "value, name",
    [
        (lambda: np.ma.masked_array([1.0, 2.0], mask=[0, 1]), "numpy.ma.MaskedArray"),
        (_matrix, "numpy.matrix"),
        (lambda: np.zeros(3).view(_Tagged), "test_unrestorable._Tagged"),
        (lambda: np.zeros(2, np.int8).view(np.recarray), "recarray"),
    ],
    ids=["masked", "matrix", "own-subclass", "recarray"],
)
def test_ndarray_subclasses_are_refused(tmp_path, value, name):
    value = value()
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=rf"Leaf `\['x'\]` is a \S*{name}, a subclass of numpy.ndarray: a "
        r"restore would give a plain numpy.ndarray and drop what the subclass "
        r"adds\.\n.*Save what the subclass holds as leaves of its own",
    ):
        oeqx.save(tmp_path / "ckpt", {"x": value})
    _nothing_left(tmp_path)


def test_every_refused_leaf_is_listed_with_each_fix(tmp_path):
    item = {
        "a": np.ma.masked_array([1.0], mask=[1]),
        "b": np.array([None], object),
        "c": np.zeros(2, [("f", "<i4")]),
    }
    with pytest.raises(oeqx.UnsupportedLeafError) as info:
        oeqx.save(tmp_path / "ckpt", item)
    text = str(info.value)
    for leaf in ("['a']", "['b']", "['c']"):
        assert f"Leaf `{leaf}`" in text
    for fix in ("as leaves of its own", "Convert an object array", "each field"):
        assert fix in text
    _nothing_left(tmp_path)


def test_memmap_is_saved_as_its_data(tmp_path):
    data = np.memmap(tmp_path / "m.bin", np.float32, "w+", shape=(3,))
    data[:] = [1.5, 2.5, 3.5]
    oeqx.save(tmp_path / "ckpt", {"x": data})
    restored = oeqx.restore(tmp_path / "ckpt", {"x": np.zeros(3, np.float32)})
    assert type(restored["x"]) is np.ndarray
    assert restored["x"].tobytes() == np.asarray(data).tobytes()


def test_a_bad_leaf_in_a_later_save_of_a_checked_structure_is_refused(tmp_path):
    # The second save of an equal tree structure checks only values.
    oeqx.save(tmp_path / "one", {"x": np.zeros(3), "y": np.zeros(2)})
    with pytest.raises(oeqx.UnsupportedLeafError, match=r"Leaf `\['x'\]` is a "):
        oeqx.save(tmp_path / "two", {"x": np.ma.masked_array(np.zeros(3)), "y": 1})
    with pytest.raises(oeqx.UnsupportedLeafError, match=r"Leaf `\['y'\]` is an "):
        oeqx.save(tmp_path / "two", {"x": np.zeros(3), "y": np.array([{}], object)})
    assert not (tmp_path / "two").exists()


def test_refused_before_a_manager_makes_a_step(tmp_path):
    mngr = ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler())
    with pytest.raises(oeqx.UnsupportedLeafError, match=r"structured dtype"):
        mngr.save(0, args=oeqx.EqxSave({"x": _STRUCTURED[0]}))
    mngr.wait_until_finished()
    assert mngr.all_steps() == []
    assert os.listdir(tmp_path / "run") == []
    mngr.close()


_NOT_IN_TENSORSTORE = [
    np.zeros(3, ml_dtypes.uint4),
    np.zeros(3, ml_dtypes.uint2),
    np.zeros(3, ml_dtypes.float8_e4m3),
    np.array(["ab", "c"]),
    np.array([b"ab", b"c"]),
    np.zeros(2, "V4"),
    np.array(["2020-01-01"], "datetime64[D]"),
    np.array([1], "timedelta64[s]"),
    np.zeros(2, np.longdouble),
    np.zeros(2, np.clongdouble),
    np.arange(3, dtype=">i4"),
    np.array(1.0, ">f8"),
    np.str_("x"),
    jnp.zeros(3, jnp.uint4),
]
_NOT_IN_TENSORSTORE_IDS = [
    "uint4",
    "uint2",
    "float8_e4m3",
    "str",
    "bytes",
    "void",
    "datetime",
    "timedelta",
    "longdouble",
    "clongdouble",
    "big-endian",
    "big-endian-0d",
    "str-scalar",
    "jax-uint4",
]


@pytest.mark.parametrize("value", _NOT_IN_TENSORSTORE, ids=_NOT_IN_TENSORSTORE_IDS)
@pytest.mark.slow
def test_pack_false_refuses_what_tensorstore_cannot_store(tmp_path, value):
    dtype = np.dtype(value.dtype)
    shown = dtype.str if not dtype.isnative else str(dtype)
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=rf"(?s)Leaf `\['x'\]` is an array of dtype {re.escape(shown)}, "
        r"which Orbax's "
        r"array store \(TensorStore, used with `pack=False`\) cannot store\.\n"
        r"Save with `pack=True` \(the default\), which stores every dtype byte "
        r"for byte, or convert the array first",
    ):
        oeqx.save(tmp_path / "ckpt", {"x": value, "ok": np.ones(2)}, pack=False)
    _nothing_left(tmp_path)
    # The default (packed) saves them byte for byte.
    oeqx.save(tmp_path / "packed", {"x": value})
    restored = oeqx.restore(tmp_path / "packed", {"x": value})
    assert np.asarray(restored["x"]).dtype == dtype
    assert np.asarray(restored["x"]).tobytes() == np.asarray(value).tobytes()


def test_pack_false_under_a_manager_writes_no_step(tmp_path):
    mngr = ocp.CheckpointManager(
        tmp_path / "run", item_handlers=oeqx.EqxHandler(pack=False)
    )
    with pytest.raises(oeqx.UnsupportedLeafError, match=r"dtype uint4, which"):
        mngr.save(0, args=oeqx.EqxSave({"x": np.zeros(3, ml_dtypes.uint4)}))
    mngr.wait_until_finished()
    assert mngr.all_steps() == []
    # The directories Orbax made for the save in the background are gone too,
    # and a save of the step right after goes through.
    assert os.listdir(tmp_path / "run") == []
    mngr.save(0, args=oeqx.EqxSave({"x": np.arange(3, dtype=np.int8)}))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0]
    assert os.listdir(tmp_path / "run") == ["0"]
    mngr.close()


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "orbax"])
@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_bool_arrays_with_bytes_other_than_0_and_1_restore(tmp_path, kind, pack):
    raw = np.array([0, 1, 2, 255, 0, 128], np.uint8)
    value = raw.view(bool) if kind == "numpy" else jnp.asarray(raw.view(bool))
    oeqx.save(tmp_path / "ckpt", {"mask": value}, pack=pack)
    skeleton = {"mask": jax.ShapeDtypeStruct((6,), bool)}
    if kind == "numpy":
        skeleton = {"mask": np.zeros(6, bool)}
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)["mask"]
    assert isinstance(restored, np.ndarray if kind == "numpy" else jax.Array)
    # Stored as 0 and 1 (the same truth values), which a restore reads on
    # every device alike.
    assert np.asarray(restored).view(np.uint8).tolist() == (raw != 0).tolist()
    assert oeqx.verify(tmp_path / "ckpt").ok


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "orbax"])
def test_a_deleted_jax_array_is_refused_naming_the_leaf(tmp_path, pack):
    gone = jnp.ones((2, 3))
    gone.delete()
    message = (
        r"Leaf `\['opt'\]\[1\]` is a jax array \(float32\[2, 3\]\) that was "
        r"deleted \(donated to a jitted function, or `.delete\(\)`d\): its data is "
        r"gone\.\nSave the arrays a step returns, not the ones it was given"
    )
    with pytest.raises(oeqx.UnsupportedLeafError, match=message):
        oeqx.save(tmp_path / "ckpt", {"w": jnp.ones(2), "opt": [1, gone]}, pack=pack)
    _nothing_left(tmp_path)
    # A later save of the same structure (checked by values only) too.
    oeqx.save(tmp_path / "ok", {"w": jnp.ones(2), "opt": [1, jnp.ones((2, 3))]})
    with pytest.raises(oeqx.UnsupportedLeafError, match=message):
        oeqx.save(tmp_path / "again", {"w": jnp.ones(2), "opt": [1, gone]})
    assert sorted(os.listdir(tmp_path)) == ["ok"]


def test_a_deleted_jax_array_under_a_manager_makes_no_step(tmp_path):
    gone = jnp.ones(3)
    gone.delete()
    mngr = ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler())
    with pytest.raises(oeqx.UnsupportedLeafError, match=r"that was deleted"):
        mngr.save(0, args=oeqx.EqxSave({"x": gone}))
    mngr.wait_until_finished()
    assert os.listdir(tmp_path / "run") == []
    mngr.close()


_SHARDED_BOOLS = """
import sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import orbax_eqx as oeqx

raw = np.array([0, 1, 2, 255, 0, 128, 7, 1], np.uint8)
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("x"))
mask = jax.make_array_from_callback((8,), sharding, lambda i: raw.view(bool)[i])
oeqx.save(sys.argv[1], {"mask": mask})
skeleton = {"mask": jax.ShapeDtypeStruct((8,), bool, sharding=sharding)}
restored = oeqx.restore(sys.argv[1], skeleton)
got = np.concatenate([np.asarray(s.data) for s in restored["mask"].addressable_shards])
assert got.view(np.uint8).tolist() == (raw != 0).tolist(), got.view(np.uint8)
assert oeqx.verify(sys.argv[1]).ok
print("ok")
"""


@pytest.mark.slow
def test_sharded_bool_arrays_with_bytes_other_than_0_and_1_restore(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": root,
    }
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_BOOLS, str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[
        -3000:
    ]
