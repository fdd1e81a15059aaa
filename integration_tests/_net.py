"""The model that the mesh and multi-host workers shard, save and restore.

Its leaves are chosen to make resharding work: weights whose saved chunks do
not line up with the restored shards, a bfloat16 leaf, typed PRNG keys (one
sharded, one not), an int32 leaf, shapes that divide over no mesh axis, a
static field and Python values. Imported by worker scripts as `_net` (they run
as plain files), so no relative imports.
"""

import hashlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_eqx as oeqx
from orbax_eqx._tree.walk import walk  # the leaf names the rules match

DIM = 16
ARRAY_LEAVES = 20  # jax arrays in `make_item`


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.attn = eqx.nn.MultiheadAttention(2, DIM, key=key)
        self.norm = eqx.nn.LayerNorm(DIM)


class Net(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    head: eqx.nn.Linear
    scale: jax.Array  # bfloat16
    odd: jax.Array  # (5, 3): divides over no mesh axis
    dropout_keys: jax.Array  # typed PRNG keys, sharded on save
    key: jax.Array  # one typed PRNG key
    counts: jax.Array  # int32
    vocab: int = eqx.field(static=True)

    def __init__(self, key, vocab=24):
        keys = jax.random.split(key, 8)
        self.embed = eqx.nn.Embedding(vocab, DIM, key=keys[0])
        self.blocks = [Block(keys[1]), Block(keys[2])]
        self.head = eqx.nn.Linear(DIM, 7, key=keys[3])
        self.scale = jax.random.normal(keys[4], (8, 6), jnp.bfloat16)
        self.odd = jax.random.normal(keys[5], (5, 3))
        self.dropout_keys = jax.random.split(keys[6], 4)
        self.key = keys[7]
        self.counts = jax.random.randint(keys[7], (16,), 0, 1000, jnp.int32)
        self.vocab = vocab


def make_item(key, step=0):
    return {"model": Net(key), "step": step, "note": "scale-out"}


def saved_item(step: int):
    """The item saved at `step`: the same values in every process, any topology.

    Filled from numpy's generator, not by running `make_item`: eager JAX
    compiles every initialiser op, seconds per process on a small machine.
    """
    rng = np.random.default_rng(step)

    def fill(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = rng.integers(0, 2**32, (*x.shape, 2), dtype=np.uint32)
            return jax.random.wrap_key_data(data, impl="threefry2x32")
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 1000, x.shape).astype(x.dtype))
        return jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype))

    shapes = eqx.filter_eval_shape(make_item, jax.random.key(0), step)
    return jtu.tree_map(fill, shapes)


def skeleton():
    """A skeleton initialised differently from every saved item."""
    return eqx.filter_eval_shape(make_item, jax.random.key(1234))


# How the model is sharded when saved, on a ("data", "model") mesh.
SAVE_RULES = [
    (r"embed\.weight$", P("data", "model")),
    (r"\.attn\..*\.weight$", P(None, "model")),
    (r"head\.weight$", P(None, "model")),
    (r"\.scale$", P("data", "model")),
    (r"dropout_keys$", P("data")),
    (r"counts$", P(("data", "model"))),
    (r".*", P()),
]

# How it is restored onto a ("data", "model") mesh of another shape: shard
# boundaries cut across the saved chunks.
RESTORE_RULES_2D = [
    (r"embed\.weight$", P("data", "model")),
    (r"\.attn\..*\.weight$", P("model", None)),
    (r"head\.weight$", P(None, "model")),
    (r"\.scale$", P(("data", "model"))),
    (r"dropout_keys$", P("model")),
    (r"counts$", P("model")),
    (r".*", P()),
]

# ... and onto a flat ("x",) mesh; attention weights become replicated.
RESTORE_RULES_1D = [
    (r"embed\.weight$", P("x")),
    (r"\.scale$", P("x")),
    (r"counts$", P("x")),
    (r".*", P()),
]


def globalize(item, shardings):
    """`item` with every jax array placed by `shardings(name, leaf)`.

    Built from this process's full copy of each value, so it works in one
    process or many (each fills in only the shards on its own devices).
    """
    walked = walk(item)
    values = []
    for leaf in walked.leaves:
        x = leaf.value
        if isinstance(x, jax.Array):
            x = _place(x, shardings(leaf.name, x))
        values.append(x)
    return jtu.tree_unflatten(walked.treedef, values)


def _place(x, sharding):
    if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        full = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda i: full[i])
    data = np.asarray(jax.random.key_data(x))
    spec = P(*sharding.spec, *[None] * (data.ndim - len(sharding.spec)))
    data_sharding = NamedSharding(sharding.mesh, spec)
    placed = jax.make_array_from_callback(data.shape, data_sharding, lambda i: data[i])
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))


def fingerprint(item) -> dict:
    """`{leaf path: [dtype, shape, sha256]}` of a fully addressable item."""
    result = {}
    for path, x in jtu.tree_flatten_with_path(item)[0]:
        if isinstance(x, jax.Array):
            data = x
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                data = jax.random.key_data(x)
            digest = hashlib.sha256(np.asarray(data).tobytes()).hexdigest()
            result[jtu.keystr(path)] = [str(x.dtype), list(x.shape), digest]
        else:
            result[jtu.keystr(path)] = repr(x)
    return result


def check_restored(restored, expected, shardings=None) -> None:
    """Asserts `restored` equals `expected` exactly, shard by shard.

    `expected` holds this process's full copy of every value. With
    `shardings` (a `(name, leaf) -> Sharding`), each array must also be
    placed as it says.
    """
    got, want = walk(restored), walk(expected)
    assert got.treedef == want.treedef, f"{got.treedef}\n!=\n{want.treedef}"
    assert got.modules == want.modules
    checked = 0
    for g, w in zip(got.leaves, want.leaves, strict=True):
        assert g.name == w.name
        if not isinstance(w.value, jax.Array):
            assert type(g.value) is type(w.value) and g.value == w.value, g.name
            continue
        x, e = g.value, w.value
        assert isinstance(x, jax.Array), (g.name, type(x))
        assert (x.dtype, x.shape) == (e.dtype, e.shape), (g.name, x.dtype, x.shape)
        if shardings is not None:
            target = shardings(g.name, x)
            assert x.sharding.is_equivalent_to(target, x.ndim), (
                g.name,
                x.sharding,
                target,
            )
        is_key = jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key)
        full = np.asarray(jax.random.key_data(e) if is_key else e)
        for shard in x.addressable_shards:
            data = jax.random.key_data(shard.data) if is_key else shard.data
            np.testing.assert_array_equal(
                np.asarray(data), full[shard.index], err_msg=g.name, strict=True
            )
        checked += 1
    assert checked == ARRAY_LEAVES, checked


def rules(mesh, which):
    return oeqx.shardings_from_rules(mesh, which)
