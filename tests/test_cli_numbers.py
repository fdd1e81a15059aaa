"""`inspect --params` (counts per module subtree and per dtype, from metadata)
and `inspect --stats` / `stats` (the numbers in each array, read a piece at a
time as `verify` reads them, and checked)."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from entry import main
from test_cli import PACKAGE_ROOT

import orbax_eqx as oeqx


@pytest.mark.slow
def test_params_per_subtree_and_dtype(tmp_path, capsys):
    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    oeqx.save(tmp_path / "ckpt", {"model": mlp, "step": 3, "key": jax.random.key(1)})
    assert main(["inspect", "--params", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out == (
        f"Checkpoint {tmp_path / 'ckpt'} (orbax_eqx item)\n"
        "\n"
        "Parameters: 131 in 7 arrays (528 B; tied weights once).\n"
        "  subtree     class   params  bytes  share\n"
        "  <root>                 131  528 B  100.0%\n"
        "    model     MLP        130  520 B  99.2%\n"
        "      layers             130  520 B  99.2%\n"
        "        0     Linear      40  160 B  30.5%\n"
        "        1     Linear      72  288 B  55.0%\n"
        "        2     Linear      18   72 B  13.7%\n"
        "\n"
        "By dtype:\n"
        "  dtype     arrays  params  bytes  share\n"
        "  float32        6     130  520 B  98.5%\n"
        "  key<fry>       1       1    8 B  1.5%\n"
    )
    assert main(["inspect", "--params", "--depth", "1", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "    model  MLP       130" in out and "layers" not in out

    assert main(["inspect", "--params", "--json", str(tmp_path / "ckpt")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == str(tmp_path / "ckpt") and doc["step"] is None
    (item,) = doc["items"]
    assert item["kind"] == "orbax_eqx" and item["stats"] is None
    params = item["params"]
    assert (params["total"], params["arrays"], params["nbytes"]) == (131, 7, 528)
    assert params["nodes"][1] == {
        "name": "model",
        "depth": 1,
        "class": "MLP",
        "params": 130,
        "nbytes": 520,
    }
    assert params["dtypes"][1] == {
        "dtype": "key<fry>",
        "arrays": 1,
        "params": 1,
        "nbytes": 8,
    }


def _tree():
    x = jnp.arange(12.0).reshape(3, 4) - 5.0
    return {
        "x": x,
        "tied": x,  # the same array: stored once, read once
        "nan": jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf, 0.0, 3.0]),
        "bf16": jnp.array([1.5, -2.0, 0.0], jnp.bfloat16),
        "flags": np.array([True, False, True]),
        "int4": np.array([-8, 7, 0, 1], ml_dtypes.int4),
        "complex": np.array([3 + 4j, 0j], np.complex64),
        "empty": jnp.zeros((0, 3)),
        "keys": jax.random.split(jax.random.key(0), 3),
    }


def _expected(name, x):
    x = np.asarray(x)
    if x.dtype == np.complex64:
        return {"l2": float(np.sqrt(np.sum(np.abs(x) ** 2))), "zeros": 1}
    wide = x.astype(np.float64).reshape(-1)
    finite = wide[np.isfinite(wide)]
    if finite.size == 0:
        return {"min": None, "l2": None, "zeros": 0}
    return {
        "min": finite.min(),
        "max": finite.max(),
        "mean": finite.mean(),
        "std": finite.std(),
        "l2": math.sqrt(np.sum(finite**2)),
        "nan": int(np.isnan(wide).sum()),
        "inf": int(np.isinf(wide).sum()),
        "zeros": int((wide == 0).sum()),
    }


@pytest.mark.parametrize("pack", [True, False], ids=["pack", "orbax-store"])
def test_stats_match_numpy(tmp_path, capsys, pack):
    tree = _tree()
    oeqx.save(tmp_path / "ckpt", tree, pack=pack)
    assert main(["inspect", "--stats", "--json", str(tmp_path / "ckpt")]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    stats = {s["name"]: s for s in item["stats"]}
    assert set(stats) == set(tree)
    for name, x in tree.items():
        if name == "keys":
            continue
        for field, value in _expected(name, x).items():
            if isinstance(value, float):
                assert math.isclose(stats[name][field], value, rel_tol=1e-9), name
            else:
                assert stats[name][field] == value, (name, field)
    assert stats["keys"] | {"path": None} == {
        "name": "keys",
        "path": None,
        "dtype": "key<fry>",
        "shape": [3],
        "size": 3,
        "nan": 0,
        "inf": 0,
        "zeros": 0,
        "min": None,
        "max": None,
        "mean": None,
        "std": None,
        "l2": None,
        "keys": True,
        "error": None,
    }
    assert stats["tied"] | {"name": "x", "path": None} == stats["x"] | {"path": None}
    assert stats["empty"]["size"] == 0 and stats["empty"]["mean"] is None


def test_stats_text(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"w": jnp.array([1.0, -1.0, jnp.nan, 0.0])})
    expected = (
        f"Checkpoint {tmp_path / 'ckpt'} (orbax_eqx item)\n"
        "\n"
        "Values of 1 array (over their finite elements):\n"
        "  min  max  mean     std     L2  zeros  nan  inf  dtype    name\n"
        "   -1    1     0  0.8165  1.414      1    1    0  float32  w\n"
        "Not finite: 1 array(s) hold NaN or Inf: w.\n"
        "\n"
        "Parameters: 4 in 1 array (16 B; tied weights once).\n"
    )
    assert main(["inspect", "--stats", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.startswith(expected)
    # `stats`, the name people try, is `inspect --stats`.
    assert main(["stats", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.startswith(expected)


def _stats(capsys, path) -> dict:
    assert main(["stats", "--json", str(path)]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    return {s["name"]: s for s in item["stats"]}


def test_stats_of_a_large_array_match_numpy(tmp_path, capsys):
    big = jax.random.normal(jax.random.key(0), (256, 1024))  # 1 MiB
    oeqx.save(tmp_path / "ckpt", {"big": big})
    s = _stats(capsys, tmp_path / "ckpt")["big"]
    host = np.asarray(big, np.float64)
    assert math.isclose(s["std"], host.std(), rel_tol=1e-9)
    assert math.isclose(s["mean"], host.mean(), rel_tol=1e-6, abs_tol=1e-12)


def test_stats_of_a_damaged_array(tmp_path, capsys):
    oeqx.save(tmp_path / "ckpt", {"w": jnp.arange(4.0), "v": jnp.ones(2)})
    saved = oeqx.metadata(tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / saved.packs[0].file, "r+b") as f:
        f.seek(saved.leaves["w"].offset)
        f.write(b"\xff")
    assert main(["stats", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^ +- +- +- +- +- +- +- +- +float32 +w$", out, re.M)
    assert re.search(
        r"^DAMAGED w: data does not match its XXH3-64: 0x[0-9a-f]{16} recorded at "
        r"save, 0x[0-9a-f]{16} computed now$",
        out,
        re.M,
    )


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np, orbax_eqx as oeqx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) - 1000.0
x = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
y = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "b")))
oeqx.save({path!r}, {{"x": x, "y": y}})
"""


@pytest.mark.slow
def test_stats_of_shard_packs(tmp_path, capsys):
    # Saved on 8 devices in a subprocess; read here, on one.
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=os.pathsep.join(
            filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])
        ),
    )
    script = textwrap.dedent(_SHARDED.format(path=str(tmp_path / "ckpt")))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    saved = oeqx.metadata(tmp_path / "ckpt")
    assert {r.data for r in saved.leaves.values()} == {"shards"}
    stats = _stats(capsys, tmp_path / "ckpt")
    x = np.arange(64 * 32, dtype=np.float64) - 1000.0
    assert (stats["x"]["min"], stats["x"]["max"]) == (-1000.0, 1047.0)
    assert stats["x"]["size"] == 2048 and stats["x"]["zeros"] == 1
    assert math.isclose(stats["x"]["mean"], x.mean(), rel_tol=1e-12)
    assert math.isclose(stats["x"]["std"], x.std(), rel_tol=1e-12)
    # Replicated over "a": each distinct shard counted once.
    assert (stats["y"]["size"], stats["y"]["l2"]) == (32, math.sqrt(32))
