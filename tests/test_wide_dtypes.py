"""64-bit leaves while JAX runs without x64: restored as saved, or refused.

Never narrowed silently: JAX's default (`jax_enable_x64` off) turns a float64
buffer into a float32 array without a word.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_eqx as oeqx

WIDE = {
    "f64": np.array([1 / 3, 1 + 2**-40, -2.5], np.float64),
    "i64": np.array([2**40 + 1, -(2**62), 7], np.int64),
    "u64": np.array([2**63 + 1, 0, 2**64 - 1], np.uint64),
    "c128": np.array([1 / 3 + 2**-40 * 1j, -1j], np.complex128),
    "scalar": np.float64(1 / 3),
}


def _structs(tree):
    return {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype) for k, v in tree.items()}


def _assert_exact(restored, expected):
    assert set(restored) == set(expected)
    for name, x in expected.items():
        assert type(restored[name]) is type(x), name
        assert restored[name].dtype == x.dtype, name
        assert np.asarray(restored[name]).tobytes() == np.asarray(x).tobytes(), name


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_numpy_64_bit_leaves_restore_as_saved_into_structs(tmp_path, pack):
    assert not jax.config.jax_enable_x64
    oeqx.save(tmp_path / "ckpt", WIDE, pack=pack)
    # A skeleton of float64 (...) structs asks for what JAX cannot make: the
    # numpy arrays come back as they were, not as float32 jax arrays.
    _assert_exact(oeqx.restore(tmp_path / "ckpt", _structs(WIDE)), WIDE)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_64_bit_leaves_without_skeleton_are_numpy(tmp_path, pack):
    with jax.enable_x64(True):
        saved = {"j64": jnp.array([1 / 3, 2.0], jnp.float64), **WIDE}
        oeqx.save(tmp_path / "ckpt", saved, pack=pack)
    restored = oeqx.restore(tmp_path / "ckpt")
    _assert_exact(restored, {**WIDE, "j64": np.asarray(saved["j64"])})


def test_eval_shape_skeleton_points_to_the_64_bit_arrays(tmp_path):
    oeqx.save(tmp_path / "ckpt", WIDE)
    skeleton = eqx.filter_eval_shape(lambda: WIDE)  # 32-bit stand-ins
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"(?s)Leaf `f64` has dtype float32 in the skeleton but float64 "
        r"\(a numpy array\) in the checkpoint\..*Leaf `u64` has dtype uint32 "
        r"in the skeleton but uint64 \(a numpy array\).*\n`eqx\.filter_eval_shape` "
        r"and `jax\.eval_shape` give 32-bit dtypes while `jax_enable_x64` is off: "
        r"to get back a saved 64-bit numpy array as it was, put "
        r"`np\.empty\(shape, dtype\)` \(or a `jax\.ShapeDtypeStruct` of the 64-bit "
        r"dtype\) at that leaf of the skeleton\.$",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    # Both ways the message gives work.
    empty = {k: np.empty(np.shape(v), v.dtype) for k, v in WIDE.items()}
    empty["scalar"] = np.float64(0)
    _assert_exact(oeqx.restore(tmp_path / "ckpt", empty), WIDE)
    _assert_exact(oeqx.restore(tmp_path / "ckpt", _structs(WIDE)), WIDE)
    # And so does the cast, which narrows because it is asked to; integers the
    # narrower dtype cannot hold are refused, not wrapped.
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `\['i64'\]` \(i64\) holds 2 values outside int32's range "
        r"\[-2147483648, 2147483647\].*\n  - Leaf `\['u64'\]` \(u64\) holds 2 "
        r"values outside uint32's range \[0, 4294967295\]",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, cast=True)
    floats = {k: v for k, v in skeleton.items() if k not in ("i64", "u64")}
    narrowed = oeqx.restore(tmp_path / "ckpt", floats, cast=True, strict=False)
    assert narrowed["f64"].dtype == jnp.float32


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_jax_64_bit_leaf_is_refused_without_x64_and_each_fix_works(tmp_path, pack):
    with jax.enable_x64(True):
        saved = {"w": jnp.array([1 / 3, 2**40 + 0.5], jnp.float64)}
        oeqx.save(tmp_path / "ckpt", saved, pack=pack)
        exact = np.asarray(saved["w"])
    skeleton = {"w": jax.ShapeDtypeStruct((2,), jnp.float64)}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `w` is a float64 jax\.ShapeDtypeStruct in the skeleton, "
        r"and a jax float64 array in the checkpoint, but JAX makes no float64 "
        r"arrays while `jax_enable_x64` is off \(it would narrow them\)\.\n"
        r"JAX holds no 64-bit arrays while `jax_enable_x64` is off \(its default\): "
        r"to restore such a leaf as saved, call "
        r"`jax\.config\.update\(\"jax_enable_x64\", True\)` before restoring; to get "
        r"it as a numpy array, put `np\.empty\(shape, dtype\)` at that leaf of the "
        r"skeleton; to narrow it to 32 bits, give that leaf the 32-bit dtype and "
        r"pass `EqxRestore\(\.\.\., cast=True\)`\.$",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton)
    with pytest.raises(oeqx.CheckpointMismatchError, match="JAX makes no float64"):
        oeqx.restore(tmp_path / "ckpt", skeleton, cast=True)  # no cast can help
    # 1. x64 on.
    with jax.enable_x64(True):
        restored = oeqx.restore(tmp_path / "ckpt", skeleton)["w"]
        assert isinstance(restored, jax.Array) and restored.dtype == jnp.float64
        assert np.asarray(restored).tobytes() == exact.tobytes()
    # 2. A numpy array in the skeleton.
    restored = oeqx.restore(tmp_path / "ckpt", {"w": np.empty(2, np.float64)})["w"]
    assert isinstance(restored, np.ndarray) and restored.tobytes() == exact.tobytes()
    # 3. Narrowed, because asked to.
    narrow = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    restored = oeqx.restore(tmp_path / "ckpt", narrow, cast=True)["w"]
    assert restored.dtype == jnp.float32
    np.testing.assert_allclose(restored, exact.astype(np.float32))


def test_struct_asking_for_64_bits_of_a_32_bit_leaf_is_refused(tmp_path):
    oeqx.save(tmp_path / "ckpt", {"w": jnp.ones(2)})
    skeleton = {"w": jax.ShapeDtypeStruct((2,), jnp.float64)}
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"Leaf `w` is a float64 jax\.ShapeDtypeStruct in the skeleton, "
        r"and a jax float32 array in the checkpoint, but JAX makes no float64 "
        r"arrays",
    ):
        oeqx.restore(tmp_path / "ckpt", skeleton, cast=True)
