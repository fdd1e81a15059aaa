"""Damaged shard packs: every fault is found, named by leaf and file, never restored.

The checkpoint is saved once, by a subprocess with 8 CPU devices (this
process has one), with arrays sharded in chunks over them; each test damages
a copy, then restores it here, onto one device, and runs `verify`.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from unblock import raised_by

import orbax_eqx as oeqx

# Its module-scoped checkpoint takes seconds to make: the whole module is slow.
pytestmark = pytest.mark.slow

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
    rng = np.random.default_rng(0)
    item = {
        "big": put(rng.standard_normal((2048, 1200)).astype(np.float32), P("a", "b")),
        "rows": put(np.arange(64 * 8, dtype=np.int32).reshape(64, 8), P("a")),
        "small": np.arange(3.0),
    }
    oeqx.save(sys.argv[1], item)
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SAVE, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    return path


def _files(path):
    token = oeqx.metadata(path).token
    return {
        p: (
            path / f"orbax_eqx~shards.{token}.{p}.bin",
            path / f"orbax_eqx~shards.{token}.{p}.json",
        )
        for p in range(oeqx.metadata(path).shard_files)
    }


def _index(path):
    _, index = _files(path)[0]
    return index, json.loads(index.read_text())


def _skeleton():
    return {
        "big": jax.ShapeDtypeStruct((2048, 1200), np.float32),
        "rows": jax.ShapeDtypeStruct((64, 8), np.int32),
        "small": np.zeros(3),
    }


def test_an_undamaged_copy_restores_and_verifies(ckpt):
    meta = oeqx.metadata(ckpt)
    assert meta.leaves["big"].data == "shards" and meta.shard_files == 1
    assert meta.leaves["big"].sharding == "P('a', 'b') over a=4, b=2"
    restored = oeqx.restore(ckpt, _skeleton())
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(
        restored["big"], rng.standard_normal((2048, 1200)).astype(np.float32)
    )
    np.testing.assert_array_equal(restored["rows"], np.arange(512).reshape(64, 8))
    report = oeqx.verify(ckpt)
    assert report.ok and set(report.checked) == {"big", "rows", "small"}


def test_a_flipped_bit_in_a_chunk(ckpt):
    data, _ = _files(ckpt)[0]
    _, index = _index(ckpt)
    start, stop, offset, nbytes, block, crcs = index["chunks"]["big"][3]
    assert len(crcs) == -(-nbytes // block) > 1
    raw = bytearray(data.read_bytes())
    raw[offset + nbytes - 5] ^= 0x10  # in the chunk's last CRC block
    data.write_bytes(bytes(raw))
    box = ", ".join(f"{a}:{b}" for a, b in zip(start, stop, strict=True))
    last = (len(crcs) - 1) * block
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"(?s)changed after it was saved.*Leaf `\['big'\]` \(big\), chunk "
        rf"\[{box}\] in {data.name}, bytes {last}-{nbytes}: CRC-32 recorded at save "
        rf"0x[0-9a-f]{{8}}, computed from the data now 0x[0-9a-f]{{8}} \(its bytes "
        r"changed, or the index moved the chunk to another box, offset, leaf or "
        r"save\).*restore_latest",
    ):
        oeqx.restore(ckpt, _skeleton())
    # The other leaf is not in that chunk, and restores.
    part = oeqx.restore(ckpt, {"rows": _skeleton()["rows"]}, strict=False)
    np.testing.assert_array_equal(part["rows"], np.arange(512).reshape(64, 8))
    report = oeqx.verify(ckpt)
    assert [d.name for d in report.damaged] == ["big"]
    assert report.damaged[0].problem.startswith(f"chunk [{box}] in {data.name}: data")


def test_verify_stops_a_leaf_at_its_first_bad_block(ckpt):
    # A damaged (or hostile: sparse, terabytes long) shard pack costs verify
    # the bytes up to the first bad block of each leaf, not the whole leaf.
    data, _ = _files(ckpt)[0]
    _, index = _index(ckpt)
    raw = bytearray(data.read_bytes())
    for chunk in index["chunks"]["big"]:
        raw[chunk[2]] ^= 0x01  # the first byte of every chunk of `big`
    data.write_bytes(bytes(raw))
    report = oeqx.verify(ckpt)
    assert [d.name for d in report.damaged] == ["big"]
    assert report.damaged[0].problem.count("CRC-32") == 1
    big = 2048 * 1200 * 4
    chunk = big // len(index["chunks"]["big"])
    rest = 64 * 8 * 4 + 3 * 8  # `rows` and `small`, read whole
    assert report.nbytes <= chunk + rest < big


@pytest.mark.parametrize("how", ["truncated", "missing", "longer"])
def test_a_shard_pack_cut_short_missing_or_longer(ckpt, how):
    data, _ = _files(ckpt)[0]
    size = data.stat().st_size
    if how == "truncated":
        with open(data, "r+b") as f:
            f.truncate(size - 100)
        found = f"it has {size - 100} bytes where its index records {size}"
    elif how == "missing":
        data.unlink()
        found = "it is missing"
    else:
        with open(data, "ab") as f:
            f.write(b"\0" * 64)
        found = f"it has {size + 64} bytes where its index records {size}"
    match = (
        rf"The shard pack {data.name} of the checkpoint in .* is damaged: {found} "
        r"\(a copy cut short, or a file deleted\)\. It holds chunks of the sharded "
        r"leaves `\['big'\]`, `\['rows'\]`\. Restore an earlier step"
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(ckpt, _skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == ["big", "rows"]
    assert "small" in report.checked


def test_a_missing_index_names_the_leaves_it_holds(ckpt):
    _, index = _files(ckpt)[0]
    index.unlink()
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {index.name} of the checkpoint in .* is damaged: "
        r"it is missing\. .* Without it, the sharded leaves `\['big'\]`, "
        r"`\['rows'\]` cannot be restored\.",
    ):
        oeqx.restore(ckpt, _skeleton())


def _edit_index(ckpt, change):
    path, content = _index(ckpt)
    change(content)
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize(
    "change, problem",
    [
        (
            lambda c: c["chunks"]["rows"][0][1].__setitem__(0, 99),
            r"leaf `\['rows'\]` \(rows\) chunk \[0:99, 0:8\] lies outside the array, "
            r"of shape \(64, 8\)",
        ),
        (
            lambda c: c["chunks"]["rows"][1].__setitem__(3, 4),
            r"leaf `\['rows'\]` \(rows\) chunk \[16:32, 0:8\] has 4 bytes where its "
            r"box needs 512",
        ),
        (
            lambda c: c["chunks"]["rows"][1].__setitem__(2, c["nbytes"]),
            r"leaf `\['rows'\]` \(rows\) chunk \[16:32, 0:8\] ends at byte \d+ of "
            r"orbax_eqx~shards\.\w+\.0\.bin, which holds \d+",
        ),
        (
            lambda c: c["chunks"]["rows"].pop(),
            r"leaf `\['rows'\]` \(rows\) has chunks covering dimension 0 up to "
            r"48 of 64",
        ),
        (
            lambda c: c["chunks"]["rows"].append(c["chunks"]["rows"][0]),
            r"leaf `\['rows'\]` \(rows\) has the same box stored twice",
        ),
        (
            lambda c: c["chunks"].__setitem__("ghost", c["chunks"]["rows"][:1]),
            r"it has chunks of `ghost`, which the sidecar does not list",
        ),
        (
            lambda c: c.__setitem__("token", "0" * 16),
            r"it names the save '0000000000000000' and process 0, expected",
        ),
    ],
    ids=[
        "box-outside",
        "size-not-box",
        "past-the-file",
        "gap",
        "twice",
        "unknown",
        "other-save",
    ],
)
def test_an_index_that_disagrees_with_the_array_or_the_pack(ckpt, change, problem):
    _edit_index(ckpt, change)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index .* is damaged: .*{problem}",
    ):
        oeqx.restore(ckpt, _skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == ["big", "rows"]


def test_an_index_that_is_not_json_or_not_a_file(ckpt):
    _, index = _files(ckpt)[0]
    index.write_text("{not json")
    with pytest.raises(oeqx.CheckpointDamagedError, match="it is not valid JSON"):
        oeqx.restore(ckpt, _skeleton())
    index.unlink()
    index.mkdir()
    with pytest.raises(
        oeqx.CheckpointDamagedError, match="it is a directory, not a regular file"
    ):
        oeqx.restore(ckpt, _skeleton())
    index.rmdir()
    os.mkfifo(index)  # refused, not waited on
    raised = raised_by(lambda: oeqx.restore(ckpt, _skeleton()), index)
    assert isinstance(raised, oeqx.CheckpointDamagedError), raised
    assert "it is a FIFO (named pipe), not a regular file" in str(raised)
