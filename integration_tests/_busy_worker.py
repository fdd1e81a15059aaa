"""Worker for test_sharded_busy.py: 400 sharded arrays on 8 CPU devices.

    python _busy_worker.py save ROOT

Saves 100 blocks of Linear(64, 64) + LayerNorm(64) (400 arrays, each sharded
P("fsdp") over the 8 devices) and restores them onto another mesh. Counts
XLA compilations while saving (JAX reports each through `jax.monitoring`):
a save must compile, so dispatch, nothing; a fresh process has nothing
compiled that a save could reuse. Prints `compiled N` and `ok`.
"""

import sys
import time

from _worker import start

args = start("mode", "root")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: (
        compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


def model():
    shapes = eqx.filter_eval_shape(
        lambda: [
            (eqx.nn.Linear(64, 64, key=jax.random.key(i)), eqx.nn.LayerNorm(64))
            for i in range(100)
        ]
    )
    rng = np.random.default_rng(0)
    return jtu.tree_map(
        lambda x: (
            rng.standard_normal(x.shape).astype(x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        shapes,
    )


values = model()
mesh = jax.make_mesh((8,), ("fsdp",))
sharding = NamedSharding(mesh, P("fsdp"))
arrays = jtu.tree_map(
    lambda x: (
        jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
        if isinstance(x, np.ndarray)
        else x
    ),
    values,
)
assert sum(isinstance(x, jax.Array) for x in jtu.tree_leaves(arrays)) == 400
began = time.perf_counter()
before = len(compiles)
oeqx.save(args.root, arrays)
took = time.perf_counter() - began
print(f"compiled {len(compiles) - before} in a save of {took:.1f} s")
assert len(compiles) == before, compiles

other = jax.make_mesh((4, 2), ("a", "b"))
target = NamedSharding(other, P("a"))
skeleton = jtu.tree_map(
    lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
        if isinstance(x, np.ndarray)
        else x
    ),
    values,
)
restored = oeqx.restore(args.root, skeleton)
for x, full in zip(jtu.tree_leaves(restored), jtu.tree_leaves(values), strict=True):
    assert x.sharding == target
    for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
print("ok", flush=True)
sys.exit(0)
