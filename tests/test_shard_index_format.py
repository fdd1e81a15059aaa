"""Shard indexes: old ones still read, and what says where a chunk is bound to it.

`old_shards_format4` (see `tests/data/README.md`) was saved before chunks'
CRC-32s were bound to their box, dtype, offset, file and save token; it must
still restore and verify. New indexes are checked against every edit that
moves a chunk's bytes to another place in the array.
"""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
import sidecars

import orbax_eqx as oeqx
from orbax_eqx._storage.sharded.index import block_size

# Its module-scoped checkpoint takes seconds to make: the whole module is slow.
pytestmark = pytest.mark.slow

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


@pytest.fixture(params=["auto", "copy"])
def staging(request, monkeypatch):
    """Both read paths: buffers handed to CPU devices as they are, and the
    staging window of accelerators (`ORBAX_EQX_STAGING=copy`)."""
    monkeypatch.setenv("ORBAX_EQX_STAGING", request.param)
    return request.param


def test_a_format_4_shard_index_still_restores_and_verifies(old, staging):
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


def test_a_flipped_bit_in_a_format_4_chunk_is_found(old, staging):
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


# ----------------------------------------------------------------- new indexes

SAVE = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import orbax_eqx as oeqx

    mesh = jax.make_mesh((4, 2), ("a", "b"))
    def put(x, spec):
        s = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, s, lambda i: x[i])
    for seed, path in enumerate(sys.argv[1:]):
        rng = np.random.default_rng(seed)
        item = {
            "a": put(rng.standard_normal((64, 32)).astype(np.float32), P("a", "b")),
            "b": put(rng.standard_normal((64, 32)).astype(np.float32), P("a", "b")),
            "big": put(rng.standard_normal((64, 4096)).astype(np.float32), P("a")),
        }
        oeqx.save(path, item)
    """
)


@pytest.fixture(scope="module")
def saved_two(tmp_path_factory):
    base = tmp_path_factory.mktemp("bound")
    paths = [base / "one", base / "two"]
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).parent.parent),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, *map(str, paths)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return paths


@pytest.fixture
def ckpt(saved_two, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(saved_two[0], path)
    return path


def _index(path):
    token = oeqx.metadata(path).token
    index = path / f"orbax_eqx~shards.{token}.0.json"
    return index, json.loads(index.read_text())


def _skeleton():
    return {
        "a": jax.ShapeDtypeStruct((64, 32), np.float32),
        "b": jax.ShapeDtypeStruct((64, 32), np.float32),
        "big": jax.ShapeDtypeStruct((64, 4096), np.float32),
    }


def test_a_new_index_has_blocks_sized_per_chunk(ckpt):
    _, content = _index(ckpt)
    assert content["format_version"] == 2 and "crc_block" not in content
    (row,) = {json.dumps(r[4:5]) for r in content["chunks"]["a"]}
    assert json.loads(row) == [1024]  # a chunk of 1 KiB: one block, all of it
    start, stop, offset, nbytes, block, crcs = content["chunks"]["big"][0]
    assert (nbytes, block, len(crcs)) == (262144, 4096, 64)
    assert [block_size(n) for n in (1, 4096, 4097, 1 << 20, 1 << 30)] == [
        1,
        4096,
        4096,
        16384,
        1 << 20,
    ]
    restored = oeqx.restore(ckpt, _skeleton())
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.testing.assert_array_equal(
            restored[name], rng.standard_normal((64, 32)).astype(np.float32)
        )
    assert oeqx.verify(ckpt).ok


def _swap_boxes(c):
    rows = c["chunks"]["a"]
    rows[0][:2], rows[1][:2] = rows[1][:2], rows[0][:2]


def _same_bytes(c):
    rows = c["chunks"]["a"]
    rows[1][2] = rows[0][2]


def _swap_leaves(c):
    a, b = c["chunks"]["a"], c["chunks"]["b"]
    a[0], b[0] = b[0], a[0]


MOVED = r"\(its bytes changed, or the index moved the chunk to another box"


@pytest.mark.parametrize(
    "change, leaves",
    [(_swap_boxes, ["a"]), (_same_bytes, ["a"]), (_swap_leaves, ["a", "b"])],
    ids=["chunks-swap-boxes", "two-chunks-one-range", "chunks-swap-leaves"],
)
def test_an_index_that_moves_chunks_is_found_by_restore_and_verify(
    ckpt, staging, change, leaves
):
    path, content = _index(ckpt)
    change(content)
    path.write_text(json.dumps(content))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"(?s)changed after it was saved.*Leaf `\['a'\]` \(a\), chunk .*{MOVED}",
    ):
        oeqx.restore(ckpt, _skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == leaves
    assert "the index moved the chunk" in report.damaged[0].problem
    # What the index did not touch still restores.
    part = oeqx.restore(ckpt, {"big": _skeleton()["big"]}, strict=False)
    assert part["big"].shape == (64, 4096)


def test_a_shard_pack_and_index_of_another_save_with_the_token_edited(saved_two, ckpt):
    other = saved_two[1]
    token, theirs = oeqx.metadata(ckpt).token, oeqx.metadata(other).token
    for suffix in ("bin", "json"):
        shutil.copyfile(
            other / f"orbax_eqx~shards.{theirs}.0.{suffix}",
            ckpt / f"orbax_eqx~shards.{token}.0.{suffix}",
        )
    path = ckpt / f"orbax_eqx~shards.{token}.0.json"
    path.write_text(path.read_text().replace(theirs, token))
    with pytest.raises(oeqx.CheckpointDamagedError, match=rf"(?s)Leaf .*{MOVED}"):
        oeqx.restore(ckpt, _skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == ["a", "b", "big"]


def test_a_sidecar_dtype_edited_to_one_of_the_same_size(ckpt):
    content = sidecars.read(ckpt)
    assert content["leaves"]["a"]["dtype"] == "float32"
    content["leaves"]["a"]["dtype"] = "int32"
    sidecars.write(ckpt, content)  # resealed: the CRC-32s find it
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=rf"(?s)Leaf `\['a'\]`.*{MOVED}"
    ):
        oeqx.restore(ckpt)
    assert [d.name for d in oeqx.verify(ckpt).damaged] == ["a"]


@pytest.mark.parametrize(
    "change, problem",
    [
        (
            lambda c: c["chunks"]["big"][0].__setitem__(4, 8192),
            r"leaf `\['big'\]` \(big\) chunk \[0:16, 0:4096\] has CRC-32s of "
            r"8192-byte blocks where a chunk of 262144 bytes has 4096-byte ones",
        ),
        (
            lambda c: c.__setitem__("format_version", 1),
            r"format_version 1 is not 2 \(a version-1 index in a checkpoint of "
            r"sidecar format 5 or later\)",
        ),
        (
            lambda c: c["chunks"].__setitem__("ghost", c["chunks"]["a"][:1]),
            r"it has chunks of `ghost`, which the sidecar does not list",
        ),
    ],
    ids=["block-size", "old-version", "unknown-leaf"],
)
def test_an_index_edited_otherwise_names_the_index_file(ckpt, change, problem):
    path, content = _index(ckpt)
    change(content)
    path.write_text(json.dumps(content))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {re.escape(path.name)} of the checkpoint in .* "
        rf"is damaged: .*{problem}",
    ):
        oeqx.restore(ckpt, _skeleton())
    assert not oeqx.verify(ckpt).ok


def test_verify_stops_a_leaf_at_its_first_bad_chunk(ckpt):
    whole = oeqx.verify(ckpt).nbytes
    path, content = _index(ckpt)
    pack = path.with_suffix(".bin")
    offset = content["chunks"]["big"][0][2]
    raw = bytearray(pack.read_bytes())
    raw[offset] ^= 1  # the first block of `big`'s first chunk
    pack.write_bytes(bytes(raw))
    report = oeqx.verify(ckpt)
    assert [d.name for d in report.damaged] == ["big"]
    # `big`'s other three chunks (256 KiB each) are not read.
    assert report.nbytes == whole - 3 * 262144
