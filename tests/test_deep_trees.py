"""Trees nested hundreds of levels deep save, restore, verify, inspect and
rebuild without a skeleton: walking and rebuilding them are loops, not
recursions (JAX flattens ~1000 levels)."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from entry import main

import orbax_eqx as oeqx


class Node(eqx.Module):
    child: object
    scale: jnp.ndarray


def _nest(kind, depth, value):
    tree = value
    for i in range(depth):
        if kind == "list":
            tree = [tree]
        elif kind == "dict":
            tree = {f"k{i % 3}": tree}
        else:
            tree = Node(tree, jnp.asarray(float(i)))
    return tree


@pytest.mark.parametrize(
    "kind, depth",
    [("list", 500), ("list", 900), ("dict", 600), ("module", 300)],
    ids=["list-500", "list-900", "dict-600", "module-300"],
)
@pytest.mark.slow
def test_deep_trees_round_trip(tmp_path, capsys, kind, depth):
    saved = _nest(kind, depth, np.arange(4.0))
    oeqx.save(tmp_path / "ckpt", saved)
    skeleton = _nest(kind, depth, np.zeros(4))
    restored = oeqx.restore(tmp_path / "ckpt", skeleton)
    got = restored
    want = saved
    for _ in range(depth):
        if kind == "list":
            got, want = got[0], want[0]
        elif kind == "dict":
            (got,), (want,) = got.values(), want.values()
        else:
            assert float(got.scale) == float(want.scale)
            got, want = got.child, want.child
    assert got.tobytes() == want.tobytes()
    assert oeqx.verify(tmp_path / "ckpt").ok
    assert len(oeqx.metadata(tmp_path / "ckpt").leaves) == (
        depth + 1 if kind == "module" else 1
    )
    assert main(["inspect", "--flat", str(tmp_path / "ckpt")]) == 0
    assert main(["verify", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "kind, depth",
    [("list", 400), ("list", 900), ("dict", 600), ("module", 300)],
    ids=["list-400", "list-900", "dict-600", "module-300"],
)
def test_deep_trees_rebuild_without_a_skeleton(tmp_path, capsys, kind, depth):
    # A real checkpoint is never called damaged for its depth.
    saved = _nest(kind, depth, np.arange(4.0))
    oeqx.save(tmp_path / "ckpt", saved)
    restored = oeqx.restore(tmp_path / "ckpt", allow=["test_deep_trees"])
    got, want = restored, saved
    for _ in range(depth):
        assert type(got) is type(want)
        if kind == "list":
            got, want = got[0], want[0]
        elif kind == "dict":
            assert got.keys() == want.keys()
            (got,), (want,) = got.values(), want.values()
        else:
            assert float(got.scale) == float(want.scale)
            got, want = got.child, want.child
    assert got.tobytes() == want.tobytes()
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    allow = "['test_deep_trees']" if kind == "module" else "[]"
    assert f"Without a skeleton: restore with `allow={allow}` to rebuild it." in out
