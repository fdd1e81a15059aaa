"""Checkpoints of sidecar format 4 (the fixtures `tests/data/format4_*`, saved
by the code of commit 9cbd3f3) restore bit for bit and verify, after format 5."""

import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import zoo

import orbax_eqx as oeqx

DATA = Path(__file__).parent / "data"


def _item(key=jax.random.key(0), scale=1.0):
    """What the fixtures hold (`scale=1`), or one of their structure with other
    values, to restore into."""
    lin = eqx.nn.Linear(3, 4, key=key)
    lin = eqx.tree_at(
        lambda m: (m.weight, m.bias),
        lin,
        (
            jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 7 * scale,
            (jnp.arange(4.0) - 1.5) * scale,
        ),
    )
    tied = np.arange(6, dtype=np.int16).reshape(2, 3) * int(scale)
    return {
        "lin": lin,
        "bf16": jnp.arange(5, dtype=jnp.bfloat16) * scale,
        "int4": np.arange(-3, 4, dtype=ml_dtypes.int4),
        "mask": np.array([True, False, True]) ^ (scale != 1.0),
        "tied_a": tied,
        "tied_b": tied,
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.float64(2.5 * scale),
        "step": 7,
        "name": "run-1",
    }


@pytest.mark.parametrize("fixture", ["format4_packed", "format4_stored"])
def test_format_4_checkpoints_restore_and_verify(tmp_path, fixture):
    path = tmp_path / fixture
    shutil.copytree(DATA / fixture, path)
    assert json.loads((path / "orbax_eqx.json").read_text())["format_version"] == 4
    skeleton = _item(jax.random.key(1), scale=3.0)
    restored = oeqx.restore(path, skeleton)
    zoo.assert_same(restored, _item())
    assert restored["tied_a"] is restored["tied_b"] or np.array_equal(
        restored["tied_a"], restored["tied_b"]
    )
    report = oeqx.verify(path)
    assert report.ok and not report.unchecked and report.checked
    assert oeqx.metadata(path).format_version == 4


def test_format_4_packed_fixture_detects_a_flipped_bit(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(DATA / "format4_packed", path)
    (pack,) = path.glob("orbax_eqx~packed.*.bin")
    data = bytearray(pack.read_bytes())
    data[0] ^= 1  # the first leaf: `bf16`
    pack.write_bytes(bytes(data))
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"Leaf `\['bf16'\]`"):
        oeqx.restore(path, _item(jax.random.key(1), scale=3.0))
    assert [d.name for d in oeqx.verify(path).damaged] == ["bf16"]
