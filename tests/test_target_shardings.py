"""Target shardings that cannot hold a leaf are one clear error, before any read.

`shardings=` (one Sharding, a tree, a function) and skeletons whose leaves
carry shardings are checked leaf by leaf: a PartitionSpec longer than the
leaf's rank, a dimension that does not divide, an axis the mesh lacks, an
`AbstractMesh` (as a skeleton built under `jax.sharding.use_abstract_mesh`
carries). Every such leaf is named at once.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_eqx as oeqx

ITEM = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.arange(3.0)}
FIX = (
    r"\nGive each such leaf a sharding over a mesh of real devices "
    r"\(`jax.sharding.Mesh\(devices, names\)`, not an AbstractMesh\) whose "
    r"PartitionSpec has at most one entry per dimension and shards only "
    r"dimensions that divide evenly \(None replicates one\), or use "
    r"`oeqx.shardings_from_rules`\.$"
)


@pytest.fixture
def saved(tmp_path):
    oeqx.save(tmp_path / "ckpt", ITEM)
    return tmp_path / "ckpt"


def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("x",))


def _skeleton(sharding_w=None, sharding_b=None):
    return {
        "w": jax.ShapeDtypeStruct((3, 4), jnp.float32, sharding=sharding_w),
        "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding_b),
    }


def test_one_sharding_longer_than_a_leaf_rank_names_the_leaf(saved):
    one = NamedSharding(_mesh(), P(None, "x"))  # fits `w`, not `b`
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"^Target shardings cannot hold these leaves:\n  - Leaf `\['b'\]` "
        r"\(shape \(3,\)\): the PartitionSpec P\(None, 'x'\) has 2 "
        r"entries, more than its rank 1\." + FIX,
    ):
        oeqx.restore(saved, _skeleton(), shardings=one)


def test_a_tree_of_shardings_is_checked_leaf_by_leaf(saved):
    mesh = _mesh()
    tree = {
        "w": NamedSharding(mesh, P(None, None, "x")),
        "b": NamedSharding(mesh, P("x", None)),
    }
    with pytest.raises(oeqx.CheckpointMismatchError) as info:
        oeqx.restore(saved, _skeleton(), shardings=tree)
    text = str(info.value)
    assert "Leaf `['w']` (shape (3, 4)): the PartitionSpec P(None, None, 'x') " in text
    assert "Leaf `['b']` (shape (3,)): the PartitionSpec P('x', None) has 2 " in text


@pytest.mark.parametrize("where", ["skeleton", "shardings"])
def test_an_abstract_mesh_is_named(saved, where):
    abstract = NamedSharding(AbstractMesh((1,), ("x",)), P())
    skeleton = _skeleton(abstract if where == "skeleton" else None)
    shardings = {"w": abstract, "b": None} if where == "shardings" else None
    with pytest.raises(
        oeqx.CheckpointMismatchError,
        match=r"^Target shardings cannot hold these leaves:\n  - Leaf `\['w'\]` "
        r"\(shape \(3, 4\)\): its sharding is over an AbstractMesh \{'x': 1\}, "
        r"which has no devices to put an array on\." + FIX,
    ):
        oeqx.restore(saved, skeleton, shardings=shardings)
    # With a concrete mesh the same restore works.
    concrete = NamedSharding(_mesh(), P())
    restored = oeqx.restore(saved, _skeleton(), shardings=concrete)
    assert np.array_equal(restored["w"], ITEM["w"])


_WORKER = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx
    path = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()), ("x",))
    skeleton = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32),
                "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    for shardings in (NamedSharding(mesh, P("x")),
                      {"w": NamedSharding(mesh, P(None, "x")),
                       "b": NamedSharding(mesh, P("x"))}):
        try:
            oeqx.restore(path, skeleton, shardings=shardings)
        except oeqx.CheckpointMismatchError as e:
            print(str(e).replace(chr(10), "|"))
    """
)


@pytest.mark.slow
def test_a_dimension_that_does_not_divide_is_named_on_4_devices(saved):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(saved)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    one, tree = proc.stdout.strip().splitlines()
    assert one.startswith("Target shardings cannot hold these leaves:|")
    for line in (one, tree):
        assert (
            "Leaf `['b']` (shape (3,)): dimension 0 (size 3) does not divide evenly "
            "into the 4 parts of mesh axes ('x',) (P('x',))." in line
        )
    assert "Leaf `['w']` (shape (3, 4)): dimension 0 (size 3)" in one
    assert "Leaf `['w']`" not in tree  # (3, 4) over P(None, 'x') fits
