"""`from_state_dict` onto 8 devices: shardings that cut a stacked leaf across
layers and within layers, each device's box filled from the pieces of the
per-layer tensors (in a subprocess with 8 fake CPU devices)."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx

    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 4), ("layers", "model"))
    w = np.arange(4 * 8 * 8, dtype=np.float32).reshape(4, 8, 8)
    tree = {"blocks": {"qkv": w, "b": np.arange(4 * 8, dtype=np.float32).reshape(4, 8)}}
    mapping = (
        oeqx.StateDictMapping()
        .stack("blocks", "h.{i}")
        .transpose("h.{i}.qkv")
        .split("h.{i}.qkv", ["h.{i}.q", "h.{i}.k", "h.{i}.v"], axis=1, sizes=[4, 2, 2])
    )
    tensors = oeqx.to_state_dict(tree, mapping)
    specs = {
        "across layers and rows": P("layers", "model"),
        "within layers": P(None, "model", None),
        "columns": P(None, None, ("layers", "model")),
        "replicated": P(),
    }
    for what, spec in specs.items():
        skeleton = {
            "blocks": {
                "qkv": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32),
                "b": jax.ShapeDtypeStruct((4, 8), jnp.float32),
            }
        }
        shardings = lambda name, leaf: NamedSharding(mesh, P(*spec[: leaf.ndim]))
        out = oeqx.from_state_dict(skeleton, tensors, mapping, shardings=shardings)
        x = out["blocks"]["qkv"]
        assert x.sharding.spec == P(*spec), (what, x.sharding)
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
        b = np.asarray(out["blocks"]["b"])
        np.testing.assert_array_equal(b, tree["blocks"]["b"])
        print("ok", what)
    """
)


@pytest.mark.slow
def test_from_state_dict_onto_eight_devices(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "XLA_FLAGS")
    }
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p
    )
    # `subprocess.run` kills the child with SIGKILL when the time is up.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 4, result.stdout
