"""Small models and tree comparisons shared by the integration tests."""

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np


def make_mlp(key: jax.Array) -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 3, 8, 2, key=key)


def skeleton_mlp(seed: int = 1234) -> eqx.nn.MLP:
    """An MLP skeleton, initialised differently from every saved model."""
    return eqx.filter_eval_shape(make_mlp, jax.random.key(seed))


def scaled(tree, factor: float):
    """`tree` with every float array multiplied by `factor`: a distinct model."""

    def scale(x):
        if eqx.is_inexact_array(x):
            return x * factor
        return x

    return jtu.tree_map(scale, tree)


class BatchNormNet(eqx.Module):
    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key: jax.Array):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        return self.bn(self.linear(x), state)


def assert_trees_equal(actual, expected) -> None:
    """Same structure; arrays of the same type, dtype, shape and exact values."""
    a_leaves, a_def = jtu.tree_flatten(actual, is_leaf=lambda x: x is None)
    e_leaves, e_def = jtu.tree_flatten(expected, is_leaf=lambda x: x is None)
    assert a_def == e_def, f"structures differ:\n{a_def}\n{e_def}"
    for (path, a), e in zip(
        jtu.tree_flatten_with_path(actual, is_leaf=lambda x: x is None)[0],
        e_leaves,
        strict=True,
    ):
        where = jtu.keystr(path)
        if isinstance(e, (jax.Array, np.ndarray, np.generic)):
            assert type(a) is type(e) or (
                isinstance(a, jax.Array) and isinstance(e, jax.Array)
            ), f"{where}: {type(a)} != {type(e)}"
            assert a.dtype == e.dtype, f"{where}: {a.dtype} != {e.dtype}"
            if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
                a, e = jax.random.key_data(a), jax.random.key_data(e)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=where)
        else:
            assert type(a) is type(e) and a == e, f"{where}: {a!r} != {e!r}"
