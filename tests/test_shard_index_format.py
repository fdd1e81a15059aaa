"""Shard indexes: old ones still read, and what says where a chunk is bound to it.

`old_shards_format4` (see `tests/data/README.md`) was saved before chunks'
CRC-32s were bound to their box, dtype, offset, file and save token; it must
still restore and verify. New indexes are checked against every edit that
moves a chunk's bytes to another place in the array.
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import orbax_eqx as oeqx

DATA = Path(__file__).parent / "data"


def _old_values():
    big = np.arange(2 * 262160, dtype=np.int64) % 7
    return {
        "big": big.astype(np.float32).reshape(2, 262160),
        "rows": np.arange(16 * 40, dtype=np.float32).reshape(16, 40) / 8,
        "ints": np.arange(8, dtype=np.int32) * 3 - 5,
        "scale": np.float32(0.5),
    }


def _old_skeleton():
    return {
        k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
        for k, v in _old_values().items()
    }


@pytest.fixture
def old(tmp_path):
    path = tmp_path / "old"
    shutil.copytree(DATA / "old_shards_format4", path)
    return path


def test_a_format_4_shard_index_still_restores_and_verifies(old):
    sidecar = json.loads((old / "orbax_eqx.json").read_text())
    assert sidecar["format_version"] == 4
    restored = oeqx.restore(old, _old_skeleton())
    for name, value in _old_values().items():
        np.testing.assert_array_equal(restored[name], value)
    # A part of a chunk, checked against the old 1 MiB blocks.
    mesh = jax.make_mesh((1,), ("x",))
    flat = oeqx.restore(old, shardings=jax.sharding.NamedSharding(mesh, jax.P()))
    np.testing.assert_array_equal(flat["big"], _old_values()["big"])
    report = oeqx.verify(old)
    assert report.ok and set(report.checked) == {"big", "rows", "ints", "scale"}


def test_a_flipped_bit_in_a_format_4_chunk_is_found(old):
    (pack,) = old.glob("orbax_eqx~shards.*.bin")
    raw = bytearray(pack.read_bytes())
    raw[1048640 + 1048576 + 3] ^= 1  # `big`'s second chunk, its second block
    pack.write_bytes(bytes(raw))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"Leaf `\['big'\]` \(big\), chunk \[1:2, 0:262160\] in "
        r"orbax_eqx~shards\.\w+\.0\.bin, bytes 1048576-1048640: CRC-32",
    ):
        oeqx.restore(old, _old_skeleton())
    report = oeqx.verify(old)
    assert [d.name for d in report.damaged] == ["big"]
