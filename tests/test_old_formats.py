"""Checkpoints of sidecar formats 4 and 5 (the fixtures `tests/data/format4_*`,
saved by the code of commit 9cbd3f3, and `format5_*`, by commit 05ae501)
restore bit for bit and verify after format 6; format 5 rebuilds without a
skeleton."""

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


FIXTURES = ["format4_packed", "format4_stored", "format5_packed", "format5_stored"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_old_checkpoints_restore_and_verify(tmp_path, fixture):
    path = tmp_path / fixture
    shutil.copytree(DATA / fixture, path)
    version = int(fixture[len("format")])
    content = json.loads((path / "orbax_eqx.json").read_text())
    assert content["format_version"] == version and "checksum" not in content
    skeleton = _item(jax.random.key(1), scale=3.0)
    restored = oeqx.restore(path, skeleton)
    zoo.assert_same(restored, _item())
    assert restored["tied_a"] is restored["tied_b"] or np.array_equal(
        restored["tied_a"], restored["tied_b"]
    )
    report = oeqx.verify(path)
    assert report.ok and not report.unchecked and report.checked
    assert oeqx.metadata(path).format_version == version
    flat = oeqx.restore(path)
    assert flat["step"] == 7 and flat["name"] == "run-1"
    np.testing.assert_array_equal(flat["lin.weight"], _item()["lin"].weight)


@pytest.mark.parametrize("fixture", ["format5_packed", "format5_stored"])
def test_format_5_checkpoints_rebuild_without_a_skeleton(tmp_path, fixture):
    path = tmp_path / fixture
    shutil.copytree(DATA / fixture, path)
    restored = oeqx.restore(path, allow=["equinox.nn"])
    zoo.assert_same(restored, _item())
    assert type(restored["lin"]) is eqx.nn.Linear


def test_format_5_records_are_not_bound_by_a_checksum(tmp_path):
    # What format 6 mends: an edited Python value of format 5 reads back as
    # edited (there is nothing to check it against), and stays readable.
    path = tmp_path / "ckpt"
    shutil.copytree(DATA / "format5_packed", path)
    sidecar = path / "orbax_eqx.json"
    sidecar.write_text(sidecar.read_text().replace('"value": 7', '"value": 6'))
    assert oeqx.restore(path)["step"] == 6


@pytest.mark.parametrize("fixture", ["format4_packed", "format5_packed"])
def test_old_packed_fixtures_detect_a_flipped_bit(tmp_path, fixture):
    path = tmp_path / "ckpt"
    shutil.copytree(DATA / fixture, path)
    (pack,) = path.glob("orbax_eqx~packed.*.bin")
    data = bytearray(pack.read_bytes())
    data[0] ^= 1  # the first leaf: `bf16`
    pack.write_bytes(bytes(data))
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"Leaf `\['bf16'\]`"):
        oeqx.restore(path, _item(jax.random.key(1), scale=3.0))
    assert [d.name for d in oeqx.verify(path).damaged] == ["bf16"]
