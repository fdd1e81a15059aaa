"""Checkpoints of arrays sharded over 8 devices, saved by a subprocess (the
test process has one CPU device), for the tests that damage shard packs and
edit shard indexes. One subprocess saves them all: it takes seconds.

- `damage`: `big` (2048x1200 float32 over a 4x2 mesh), `rows` (64x8 int32,
  split in 4 along its rows), `small` (not sharded).
- `one`, `two`: `a`, `b` (64x32 float32 over the 4x2 mesh) and `big`
  (64x4096 float32 in 4 row blocks), of seeds 0 and 1.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np

import orbax_eqx as oeqx

_SAVE = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx

    mesh = jax.make_mesh((4, 2), ("a", "b"))
    def put(x, spec):
        s = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, s, lambda i: x[i])
    rng = np.random.default_rng(0)
    item = {
        "big": put(rng.standard_normal((2048, 1200)).astype(np.float32), P("a", "b")),
        "rows": put(np.arange(64 * 8, dtype=np.int32).reshape(64, 8), P("a")),
        "small": np.arange(3.0),
    }
    oeqx.save(sys.argv[1], item)
    for seed, path in enumerate(sys.argv[2:]):
        rng = np.random.default_rng(seed)
        item = {
            "a": put(rng.standard_normal((64, 32)).astype(np.float32), P("a", "b")),
            "b": put(rng.standard_normal((64, 32)).astype(np.float32), P("a", "b")),
            "big": put(rng.standard_normal((64, 4096)).astype(np.float32), P("a")),
        }
        oeqx.save(path, item)
    """
)


def save_all(base: Path) -> dict[str, Path]:
    """Saves the checkpoints `damage`, `one` and `two` under `base`."""
    paths = {name: base / name for name in ("damage", "one", "two")}
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).parent.parent),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE, *map(str, paths.values())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return paths


def damage_skeleton():
    return {
        "big": jax.ShapeDtypeStruct((2048, 1200), np.float32),
        "rows": jax.ShapeDtypeStruct((64, 8), np.int32),
        "small": np.zeros(3),
    }


def seeded_skeleton():
    return {
        "a": jax.ShapeDtypeStruct((64, 32), np.float32),
        "b": jax.ShapeDtypeStruct((64, 32), np.float32),
        "big": jax.ShapeDtypeStruct((64, 4096), np.float32),
    }


def shard_files(path) -> dict[int, tuple[Path, Path]]:
    """`{process: (shard pack, its index)}` of the checkpoint at `path`."""
    saved = oeqx.metadata(path)
    return {
        p: (
            path / f"orbax_eqx~shards.{saved.token}.{p}.bin",
            path / f"orbax_eqx~shards.{saved.token}.{p}.json",
        )
        for p in range(saved.shard_files)
    }


def index_of(path) -> tuple[Path, dict]:
    """Process 0's shard index of the checkpoint at `path`, and its JSON."""
    _, index = shard_files(path)[0]
    return index, json.loads(index.read_text())
