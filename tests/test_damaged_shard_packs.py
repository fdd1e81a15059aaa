"""Shard packs and their indexes, damaged or edited: every fault is found,
named by leaf and file, never restored, by a restore and by `verify`, which
reads no further than the first bad block of a leaf.

The checkpoints are saved once per module by a subprocess with 8 CPU devices
(`tests/sharded_saves.py`), with arrays sharded in chunks over them; each
test damages a copy, then restores it here, onto one device.
"""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import sidecars
from sharded_saves import (
    damage_skeleton,
    index_of,
    save_all,
    seeded_skeleton,
    shard_files,
)
from unblock import raised_by

import orbax_eqx as oeqx

# Its module-scoped checkpoints take seconds to make: the whole module is slow.
pytestmark = pytest.mark.slow


# --- damaged shard packs -------------------------------------------------------
# The checksum block of a chunk is docs/guides/format.md's rule, checked on
# every chunk a save writes.

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    return save_all(tmp_path_factory.mktemp("sharded"))


@pytest.fixture
def ckpt(saves, tmp_path):
    """A copy of the checkpoint `damage`."""
    path = tmp_path / "ckpt"
    shutil.copytree(saves["damage"], path)
    return path


@pytest.fixture
def seeded(saves, tmp_path):
    """A copy of the checkpoint `one`."""
    path = tmp_path / "seeded"
    shutil.copytree(saves["one"], path)
    return path


def test_an_undamaged_copy_restores_and_verifies(ckpt):
    meta = oeqx.metadata(ckpt)
    assert meta.leaves["big"].data == "shards" and meta.shard_files == 1
    assert meta.leaves["big"].sharding == "P('a', 'b') over a=4, b=2"
    restored = oeqx.restore(ckpt, damage_skeleton())
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(
        restored["big"], rng.standard_normal((2048, 1200)).astype(np.float32)
    )
    np.testing.assert_array_equal(restored["rows"], np.arange(512).reshape(64, 8))
    report = oeqx.verify(ckpt)
    assert report.ok and set(report.checked) == {"big", "rows", "small"}


def test_a_flipped_bit_in_a_chunk(ckpt):
    data, _ = shard_files(ckpt)[0]
    _, index = index_of(ckpt)
    start, stop, offset, nbytes, block, crcs = index["chunks"]["big"][3]
    assert len(crcs) == -(-nbytes // block) > 1
    raw = bytearray(data.read_bytes())
    raw[offset + nbytes - 5] ^= 0x10  # in the chunk's last checksum block
    data.write_bytes(bytes(raw))
    box = ", ".join(f"{a}:{b}" for a, b in zip(start, stop, strict=True))
    last = (len(crcs) - 1) * block
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"(?s)changed after it was saved.*Leaf `\['big'\]` \(big\), chunk "
        rf"\[{box}\] in {data.name}, bytes {last}-{nbytes}: XXH3-64 recorded at save "
        rf"0x[0-9a-f]{{16}}, computed from the data now 0x[0-9a-f]{{16}}\..*"
        r"restore_latest",
    ):
        oeqx.restore(ckpt, damage_skeleton())
    # The other leaf is not in that chunk, and restores.
    part = oeqx.restore(ckpt, {"rows": damage_skeleton()["rows"]}, strict=False)
    np.testing.assert_array_equal(part["rows"], np.arange(512).reshape(64, 8))
    report = oeqx.verify(ckpt)
    assert [d.name for d in report.damaged] == ["big"]
    assert report.damaged[0].problem.startswith(f"chunk [{box}] in {data.name}: data")


def test_verify_stops_a_leaf_at_its_first_bad_block(ckpt):
    # A damaged (or hostile: sparse, terabytes long) shard pack costs verify
    # the bytes up to the first bad block of each leaf, not the whole leaf.
    data, _ = shard_files(ckpt)[0]
    _, index = index_of(ckpt)
    raw = bytearray(data.read_bytes())
    for chunk in index["chunks"]["big"]:
        raw[chunk[2]] ^= 0x01  # the first byte of every chunk of `big`
    data.write_bytes(bytes(raw))
    report = oeqx.verify(ckpt)
    assert [d.name for d in report.damaged] == ["big"]
    assert report.damaged[0].problem.count("XXH3-64") == 1
    big = 2048 * 1200 * 4
    chunk = big // len(index["chunks"]["big"])
    rest = 64 * 8 * 4 + 3 * 8  # `rows` and `small`, read whole
    assert report.nbytes <= chunk + rest < big


def test_verify_stops_a_leaf_at_its_first_bad_chunk(seeded):
    whole = oeqx.verify(seeded).nbytes
    path, content = index_of(seeded)
    pack = path.with_suffix(".bin")
    offset = content["chunks"]["big"][0][2]
    raw = bytearray(pack.read_bytes())
    raw[offset] ^= 1  # the first block of `big`'s first chunk
    pack.write_bytes(bytes(raw))
    report = oeqx.verify(seeded)
    assert [d.name for d in report.damaged] == ["big"]
    # `big`'s other three chunks (256 KiB each) are not read.
    assert report.nbytes == whole - 3 * 262144


@pytest.mark.parametrize("how", ["truncated", "missing", "longer"])
def test_a_shard_pack_cut_short_missing_or_longer(ckpt, how):
    data, _ = shard_files(ckpt)[0]
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
        oeqx.restore(ckpt, damage_skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == ["big", "rows"]
    assert "small" in report.checked


def test_a_missing_index_names_the_leaves_it_holds(ckpt):
    _, index = shard_files(ckpt)[0]
    index.unlink()
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {index.name} of the checkpoint in .* is damaged: "
        r"it is missing\. .* Without it, the sharded leaves `\['big'\]`, "
        r"`\['rows'\]` cannot be restored\.",
    ):
        oeqx.restore(ckpt, damage_skeleton())


def block_size(nbytes: int) -> int:
    """The checksum block of a chunk of `nbytes` (docs/guides/format.md): the
    whole chunk up to 4 KiB, else a 64th of it rounded up to a multiple of
    4 KiB, at most 1 MiB."""
    if nbytes <= 4096:
        return max(nbytes, 1)
    return min(1 << 20, -(-(-(-nbytes // 64)) // 4096) * 4096)


def test_a_new_index_has_blocks_sized_per_chunk(seeded):
    _, content = index_of(seeded)
    assert content["format_version"] == 7
    (row,) = {json.dumps(r[4:5]) for r in content["chunks"]["a"]}
    assert json.loads(row) == [1024]  # a chunk of 1 KiB: one block, all of it
    start, stop, offset, nbytes, block, sums = content["chunks"]["big"][0]
    assert (nbytes, block, len(sums)) == (262144, 4096, 64)
    assert all(re.fullmatch("[0-9a-f]{16}", x) for x in sums)  # XXH3-64s
    for chunks in content["chunks"].values():
        assert all(chunk[4] == block_size(chunk[3]) for chunk in chunks)
    assert [block_size(n) for n in (1, 4096, 4097, 1 << 20, 1 << 30)] == [
        1,
        4096,
        4096,
        16384,
        1 << 20,
    ]
    restored = oeqx.restore(seeded, seeded_skeleton())
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.testing.assert_array_equal(
            restored[name], rng.standard_normal((64, 32)).astype(np.float32)
        )
    assert oeqx.verify(seeded).ok


# --- hostile shard indexes -----------------------------------------------------
# Hostile shard indexes: an index edited (and resealed) to disagree with its
# array or its shard pack, an index edited without its seal, or one that is no
# JSON file at all. Each is damage, named by the index file, to a restore and
# to `verify`.
#
# The checkpoints are saved once per module by a subprocess with 8 CPU devices
# (`tests/sharded_saves.py`); each test edits a copy.


@pytest.fixture(params=[None, 8 << 20], ids=["auto", "copy"])
def staging(request):
    """Both read paths, as `max_staged_bytes`: buffers handed to CPU devices as
    they are, and a window, which CPU devices copy through as an
    accelerator's do."""
    return request.param


def _edit_index(ckpt, change):
    """Edits process 0's index and reseals it, as an attacker would."""
    path, content = index_of(ckpt)
    change(content)
    sidecars.write_json(path, content)
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
        oeqx.restore(ckpt, damage_skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == ["big", "rows"]


def test_an_index_that_is_not_json_or_not_a_file(ckpt):
    _, index = shard_files(ckpt)[0]
    index.write_text("{not json")
    with pytest.raises(oeqx.CheckpointDamagedError, match="records no checksum"):
        oeqx.restore(ckpt, damage_skeleton())
    index.unlink()
    index.mkdir()
    with pytest.raises(
        oeqx.CheckpointDamagedError, match="it is a directory, not a regular file"
    ):
        oeqx.restore(ckpt, damage_skeleton())
    index.rmdir()
    os.mkfifo(index)  # refused, not waited on
    raised = raised_by(lambda: oeqx.restore(ckpt, damage_skeleton()), index)
    assert isinstance(raised, oeqx.CheckpointDamagedError), raised
    assert "it is a FIFO (named pipe), not a regular file" in str(raised)


# --- indexes edited without their seal: damage before any chunk is read -------


def _swap_boxes(c):
    rows = c["chunks"]["a"]
    rows[0][:2], rows[1][:2] = rows[1][:2], rows[0][:2]


def _same_bytes(c):
    rows = c["chunks"]["a"]
    rows[1][2] = rows[0][2]


def _swap_leaves(c):
    a, b = c["chunks"]["a"], c["chunks"]["b"]
    a[0], b[0] = b[0], a[0]


@pytest.mark.parametrize(
    "change",
    [_swap_boxes, _same_bytes, _swap_leaves],
    ids=["chunks-swap-boxes", "two-chunks-one-range", "chunks-swap-leaves"],
)
def test_an_index_that_moves_chunks_is_found_by_restore_and_verify(
    seeded, staging, change
):
    path, content = index_of(seeded)
    text = path.read_text()
    change(content)
    content.pop("checksum")
    # The old checksum line kept: it no longer matches what precedes it.
    body = json.dumps(content)[:-1] + ",\n" + text[text.rindex(' "checksum"') :]
    path.write_text(body)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {re.escape(path.name)} .* is damaged: it does not "
        r"match its checksum",
    ):
        oeqx.restore(seeded, seeded_skeleton(), max_staged_bytes=staging)
    report = oeqx.verify(seeded)
    assert sorted(d.name for d in report.damaged) == ["a", "b", "big"]


def test_a_shard_pack_and_index_of_another_save_with_the_token_edited(saves, seeded):
    other = saves["two"]
    token, theirs = oeqx.metadata(seeded).token, oeqx.metadata(other).token
    for suffix in ("bin", "json"):
        shutil.copyfile(
            other / f"orbax_eqx~shards.{theirs}.0.{suffix}",
            seeded / f"orbax_eqx~shards.{token}.0.{suffix}",
        )
    path = seeded / f"orbax_eqx~shards.{token}.0.json"
    path.write_text(path.read_text().replace(theirs, token))
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=r"does not match its checksum"
    ):
        oeqx.restore(seeded, seeded_skeleton())
    report = oeqx.verify(seeded)
    assert sorted(d.name for d in report.damaged) == ["a", "b", "big"]


@pytest.mark.parametrize(
    "change, problem",
    [
        (
            lambda c: c["chunks"]["big"][0].__setitem__(4, 8192),
            r"leaf `\['big'\]` \(big\) chunk \[0:16, 0:4096\] has XXH3-64s of "
            r"8192-byte blocks where a chunk of 262144 bytes has 4096-byte ones",
        ),
        (
            lambda c: c.__setitem__("format_version", 6),
            r"is of format version 6; this orbax_eqx reads format version 7 only",
        ),
        (
            lambda c: c["chunks"]["big"][0][5].__setitem__(0, "DEADBEEF"),
            r"Expected `str` matching regex",
        ),
        (
            lambda c: c["chunks"]["big"][0][5].__setitem__(0, 12345),
            r"Expected `str`, got `int`",
        ),
    ],
    ids=["block-size", "old-version", "sum-not-hex", "sum-an-int"],
)
def test_an_index_edited_otherwise_names_the_index_file(seeded, change, problem):
    path, content = index_of(seeded)
    change(content)
    sidecars.write_json(path, content)  # resealed: the reader's rules are probed
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {re.escape(path.name)} of the checkpoint in .* "
        rf"is damaged: .*{problem}",
    ):
        oeqx.restore(seeded, seeded_skeleton())
    assert not oeqx.verify(seeded).ok
