"""The benchmark's models, each built deterministically from a PRNG key.

- `transformer`: (a) ~0.5 GiB in ~100 arrays: embedding, 8 blocks of
  attention + MLP + LayerNorms, final LayerNorm.
- `deep`: (b) a deep residual stack of small layers plus its optax Adam
  state: ~6,300 arrays, ~17 MiB, the shape of a many-leaf training state.
- `big`: (c) the transformer at ~2 GiB.

Imported by `run.py` and, in a fresh process, by `_probe.py`.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 1, activation=jax.nn.gelu, key=k2)


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    dim: int = eqx.field(static=True)

    def __init__(self, vocab, dim, depth, heads, key):
        keys = jax.random.split(key, depth + 1)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.blocks = [Block(dim, heads, k) for k in keys[1:]]
        self.norm = eqx.nn.LayerNorm(dim)
        self.dim = dim


class Residual(eqx.Module):
    lin1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    lin2: eqx.nn.Linear
    gain: jax.Array

    def __init__(self, width, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(width, width, key=k1)
        self.norm = eqx.nn.LayerNorm(width)
        self.lin2 = eqx.nn.Linear(width, width, key=k2)
        self.gain = jnp.ones(())


class Deep(eqx.Module):
    inp: eqx.nn.Linear
    blocks: list[Residual]
    out: eqx.nn.Linear

    def __init__(self, width, depth, key):
        keys = jax.random.split(key, depth + 2)
        self.inp = eqx.nn.Linear(16, width, key=keys[0])
        self.blocks = [Residual(width, k) for k in keys[2:]]
        self.out = eqx.nn.Linear(width, 16, key=keys[1])


def _transformer(vocab, dim, depth, heads):
    def make(key):
        return Transformer(vocab, dim, depth, heads, key)

    return make


def _deep(key):
    model = Deep(48, 300, key)
    opt = optax.adam(1e-3)
    state = opt.init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": state, "step": 1000}


@dataclasses.dataclass(frozen=True)
class Spec:
    label: str
    make: object  # key -> item


MODELS = {
    "a": Spec("(a) transformer ~0.5 GiB", _transformer(32000, 1024, 8, 16)),
    "b": Spec("(b) deep model + Adam state", _deep),
    "c": Spec("(c) transformer ~2 GiB", _transformer(32000, 2048, 10, 16)),
}


def skeleton(name: str, seed: int = 1):
    """What a user restores into: shapes and dtypes only, no memory."""
    return eqx.filter_eval_shape(MODELS[name].make, jax.random.key(seed))


def build(name: str, seed: int = 0):
    """The model `name` with every array drawn at random, on the default device.

    Random normal values, not the constructors' ones and zeros (LayerNorm,
    Adam's moments): constants compress too well to be a fair test of a disk.
    Drawn with numpy, which is much faster than initialising through JAX.
    """
    rng = np.random.default_rng(seed)

    def fill(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            value = rng.standard_normal(x.shape, np.float32).astype(x.dtype)
        else:
            value = rng.integers(0, 100, x.shape).astype(x.dtype)
        return jnp.asarray(value)

    item = jax.tree_util.tree_map(fill, skeleton(name, seed))
    return jax.block_until_ready(item)


def array_leaves(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]
