"""A small zoo of PyTrees that users checkpoint, each built from a PRNG key.

Every entry is `make(key) -> item`. Building the same entry from two keys
gives two trees of one structure with different values, so a restore into
the second proves that values came from disk.
"""

import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


def mlp(key):
    return eqx.nn.MLP(3, 2, 8, 2, key=key)


class Block(eqx.Module):
    """A transformer block with a static hyperparameter."""

    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    num_heads: int = eqx.field(static=True)

    def __init__(self, key, num_heads=2, dim=8):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(num_heads, dim, key=k1)
        self.norm = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 16, 1, activation=jax.nn.gelu, key=k2)
        self.num_heads = num_heads

    def __call__(self, x):
        x = x + self.attn(x, x, x)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))


def transformer_block(key):
    return Block(key)


class BNModel(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key):
        self.lin = eqx.nn.Linear(3, 4, key=key)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.bn(self.lin(x), state)


def batchnorm_state(key):
    model, state = eqx.nn.make_with_state(BNModel)(key)
    # Move the running statistics away from their initial values.
    x = jax.random.normal(key, (5, 3))
    _, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    return model, state


class TiedLM(eqx.Module):
    """Embedding and output projection share one weight via `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        embed = eqx.nn.Embedding(10, 4, key=k1)
        head = eqx.nn.Linear(4, 10, use_bias=False, key=k2)
        self.shared = eqx.nn.Shared(
            (embed, head), lambda p: p[1].weight, lambda p: p[0].weight
        )

    def __call__(self, token):
        embed, head = self.shared()
        return head(embed(token))


def shared_tied(key):
    return TiedLM(key)


def vmap_stacked(key):
    keys = jax.random.split(key, 3)
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(keys)


def prng_keys(key):
    seed = int(jax.random.randint(key, (), 0, 2**30))
    return {
        "threefry": jax.random.key(seed),
        "rbg": jax.random.key(seed, impl="rbg"),
        "batch": jax.random.split(jax.random.key(seed), 3),
        "legacy": jax.random.PRNGKey(seed),
        "none_left": jax.random.split(jax.random.key(seed), 0),
    }


def odd_dict_keys(key):
    k = jax.random.split(key, 8)
    return {
        "a.b": jax.random.normal(k[0], (2,)),
        "a": {"b": jax.random.normal(k[1], (2,))},
        "back\\slash": jax.random.normal(k[2], (2,)),
        "7": jax.random.normal(k[3], (2,)),
        "": jax.random.normal(k[4], (2,)),
        "w/x ü": jax.random.normal(k[5], (2,)),
        "ints": {0: jax.random.normal(k[6], (2,)), 12: (1, 2)},
        "x" * 300: jax.random.normal(k[7], (2,)),
    }


def optax_state(key):
    model = mlp(key)
    params = eqx.filter(model, eqx.is_array)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = opt.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.ones_like(p), params)
    _, state = opt.update(grads, state, params)
    return {"model": model, "opt_state": state, "step": 3}


def dtypes(key):
    seed = int(jax.random.randint(key, (), 0, 100))
    x = jnp.arange(seed, seed + 6, dtype=jnp.float32) / 7
    return {
        "f32": x,
        "bf16": x.astype(jnp.bfloat16),
        "f16": x.astype(jnp.float16),
        "fp8_e4m3": x.astype(jnp.float8_e4m3fn),
        "fp8_e5m2": x.astype(jnp.float8_e5m2),
        "int4": (jnp.arange(6) % 7 - seed % 3).astype(jnp.int4),
        "int8": jnp.arange(6, dtype=jnp.int8) - seed,
        "uint32": jnp.arange(6, dtype=jnp.uint32) + seed,
        "bool": jnp.arange(6) % (seed % 3 + 2) == 0,
        "c64": x.astype(jnp.complex64) * (1 + 2j),
        "scalar0d": jnp.asarray(seed, jnp.float32),
        "empty": jnp.zeros((0, 3)),
    }


def numpy_leaves(key):
    seed = int(jax.random.randint(key, (), 0, 100))
    return {
        "f64": np.arange(4, dtype=np.float64) / (seed + 3),
        "i64": np.arange(4, dtype=np.int64) * 2**40 + seed,
        "np_scalar": np.float32(seed) / 3,
        "empty": np.zeros((2, 0), np.int16),
    }


def python_scalars(key):
    seed = int(jax.random.randint(key, (), 0, 100))
    return {
        "int": seed,
        "big": 2**70 + seed,
        "neg_big": -(2**65) - seed,
        "float": 0.1 + seed,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "neg_zero": -0.0,
        "bool": seed % 2 == 0,
        "str": f"héllo {seed}",
        "none": None,
        "complex": complex(seed, -0.5),
        "bytes": bytes([seed, 0, 255]),
        "tuple": (seed, "a", (1.5,)),
    }


ZOO = {
    "mlp": mlp,
    "transformer_block": transformer_block,
    "batchnorm_state": batchnorm_state,
    "shared_tied": shared_tied,
    "vmap_stacked": vmap_stacked,
    "prng_keys": prng_keys,
    "odd_dict_keys": odd_dict_keys,
    "optax_state": optax_state,
    "dtypes": dtypes,
    "numpy_leaves": numpy_leaves,
    "python_scalars": python_scalars,
}


_PYTHON_FROM_KEY = (prng_keys, dtypes, python_scalars)


def skeleton(make, key):
    """What a user restores into: shapes only, except where that loses facts.

    `filter_eval_shape` turns numpy float64 leaves into float32 structs (JAX
    runs without x64), so trees with numpy leaves use a concrete skeleton.
    """
    if make is numpy_leaves:
        return make(key)
    if make in _PYTHON_FROM_KEY:
        # Python values drawn from the key cannot be traced: build, then abstract.
        return jax.tree_util.tree_map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype)
                if isinstance(x, jax.Array)
                else x
            ),
            make(key),
        )
    return eqx.filter_eval_shape(make, key)


def _callable_name(fn):
    """What a checkpoint records of a callable: its name, and a partial's
    arguments (without the memory addresses of their reprs)."""
    if isinstance(fn, functools.partial):
        args = (*fn.args, *sorted(fn.keywords.items()))
        return (_callable_name(fn.func), re.sub(r" at 0x[0-9a-f]+", "", repr(args)))
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))


def assert_same(restored, expected):
    """Same structure, same leaf types, bit-identical values."""
    r_leaves, r_def = jax.tree_util.tree_flatten(restored, is_leaf=lambda x: x is None)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected, is_leaf=lambda x: x is None)
    assert r_def == e_def
    for r, e in zip(r_leaves, e_leaves, strict=True):
        assert type(r) is type(e) or (
            isinstance(r, jax.Array) and isinstance(e, jax.Array)
        ), (type(r), type(e))
        if isinstance(e, (jax.Array, np.ndarray, np.generic)):
            assert r.dtype == e.dtype and r.shape == e.shape
            if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
                r, e = jax.random.key_data(r), jax.random.key_data(e)
            assert np.asarray(r).tobytes() == np.asarray(e).tobytes()
        elif isinstance(e, (float, complex)):
            assert repr(r) == repr(e)
        elif callable(e):
            assert _callable_name(r) == _callable_name(e)
        elif type(e).__name__ == "SharedNode":
            pass  # a placeholder: its type is all there is
        else:
            assert r == e
