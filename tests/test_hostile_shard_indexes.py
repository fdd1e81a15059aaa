"""Hostile shard indexes: an index edited to disagree with its array or its
shard pack, to move chunks to another box, offset, leaf or save, or that is
no JSON file at all. Each is damage, named by the index file, to a restore
and to `verify`; what the index did not touch still restores.

The checkpoints are saved once per module by a subprocess with 8 CPU devices
(`tests/sharded_saves.py`); each test edits a copy.
"""

import json
import os
import re
import shutil

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


@pytest.fixture(params=["auto", "copy"])
def staging(request, monkeypatch):
    """Both read paths: buffers handed to CPU devices as they are, and the
    staging window of accelerators (`ORBAX_EQX_STAGING=copy`)."""
    monkeypatch.setenv("ORBAX_EQX_STAGING", request.param)
    return request.param


def _edit_index(ckpt, change):
    path, content = index_of(ckpt)
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
        oeqx.restore(ckpt, damage_skeleton())
    report = oeqx.verify(ckpt)
    assert sorted(d.name for d in report.damaged) == ["big", "rows"]


def test_an_index_that_is_not_json_or_not_a_file(ckpt):
    _, index = shard_files(ckpt)[0]
    index.write_text("{not json")
    with pytest.raises(oeqx.CheckpointDamagedError, match="it is not valid JSON"):
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


# --- indexes that move chunks: found by the CRC-32s bound to where they are -------


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
    seeded, staging, change, leaves
):
    path, content = index_of(seeded)
    change(content)
    path.write_text(json.dumps(content))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"(?s)changed after it was saved.*Leaf `\['a'\]` \(a\), chunk .*{MOVED}",
    ):
        oeqx.restore(seeded, seeded_skeleton())
    report = oeqx.verify(seeded)
    assert sorted(d.name for d in report.damaged) == leaves
    assert "the index moved the chunk" in report.damaged[0].problem
    # What the index did not touch still restores.
    part = oeqx.restore(seeded, {"big": seeded_skeleton()["big"]}, strict=False)
    assert part["big"].shape == (64, 4096)


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
    with pytest.raises(oeqx.CheckpointDamagedError, match=rf"(?s)Leaf .*{MOVED}"):
        oeqx.restore(seeded, seeded_skeleton())
    report = oeqx.verify(seeded)
    assert sorted(d.name for d in report.damaged) == ["a", "b", "big"]


def test_a_sidecar_dtype_edited_to_one_of_the_same_size(seeded):
    content = sidecars.read(seeded)
    assert content["leaves"]["a"]["dtype"] == "float32"
    content["leaves"]["a"]["dtype"] = "int32"
    sidecars.write(seeded, content)  # resealed: the CRC-32s find it
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=rf"(?s)Leaf `\['a'\]`.*{MOVED}"
    ):
        oeqx.restore(seeded)
    assert [d.name for d in oeqx.verify(seeded).damaged] == ["a"]


@pytest.mark.parametrize(
    "change, problem",
    [
        (
            lambda c: c["chunks"]["big"][0].__setitem__(4, 8192),
            r"leaf `\['big'\]` \(big\) chunk \[0:16, 0:4096\] has XXH3-64s of "
            r"8192-byte blocks where a chunk of 262144 bytes has 4096-byte ones",
        ),
        (
            lambda c: c.__setitem__("format_version", 1),
            r"format_version 1 is not 3 \(a version-1 index where the save wrote "
            r"version 3: put in by hand\)",
        ),
        (
            # CRC-32s (version 2's) where the save wrote XXH3-64s: a downgrade.
            lambda c: c.__setitem__("format_version", 2),
            r"format_version 2 is not 3 \(a version-2 index where the save wrote "
            r"version 3: put in by hand\)",
        ),
        (
            lambda c: c["chunks"]["big"][0][5].__setitem__(0, "DEADBEEF"),
            r"a chunk of `big` is not \[start, stop, offset, nbytes, block, xxh3s\]",
        ),
        (
            lambda c: c["chunks"]["big"][0][5].__setitem__(0, 12345),
            r"a chunk of `big` is not \[start, stop, offset, nbytes, block, xxh3s\]",
        ),
    ],
    ids=["block-size", "old-version", "crc32-version", "sum-not-hex", "sum-an-int"],
)
def test_an_index_edited_otherwise_names_the_index_file(seeded, change, problem):
    path, content = index_of(seeded)
    change(content)
    path.write_text(json.dumps(content))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=rf"The shard index {re.escape(path.name)} of the checkpoint in .* "
        rf"is damaged: .*{problem}",
    ):
        oeqx.restore(seeded, seeded_skeleton())
    assert not oeqx.verify(seeded).ok
