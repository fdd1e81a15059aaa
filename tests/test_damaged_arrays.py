"""Damaged array bytes: every flipped bit is found by the checksums, by
`verify` and by a restore, for packed arrays and for arrays in Orbax's array
store alike; a pack file of the wrong size, and an Orbax array store with
files deleted or cut short, are damage, said in one error that touches nothing."""

import gc
import json
import os
import random
import re
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from untouched import fails_touching_nothing

import orbax_eqx as oeqx


def _pack(path):
    """The pack file of the checkpoint at `path` (its name holds the save's token)."""
    return path / oeqx.metadata(path).packs[0].file


FLIPS_PACKED = 60
FLIPS_STORED = 50


def _item(seed=1):
    """Arrays of several dtypes, random enough to be found by their bytes, and
    big enough (over 1 KiB) that OCDBT stores them apart from its b-tree."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    return {
        "w": jax.random.normal(k1, (24, 16)),
        "b16": jax.random.normal(k2, (600,)).astype(jnp.bfloat16),
        "ids": jax.random.randint(k3, (330,), 0, 2**30),
        "np": np.random.default_rng(seed).random(200),
        "keys": jax.random.split(k4, 160),
        "mask": jax.random.bernoulli(k1, 0.5, (1100,)),
        "step": 3,
    }


def _skeleton():
    """Shapes for the jax arrays; the numpy leaf concrete (see `zoo.skeleton`)."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
        ),
        _item(0),
    )


def _flip(path, byte: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(byte)
        (value,) = f.read(1)
        f.seek(byte)
        f.write(bytes([value ^ (1 << bit)]))


def _packed_spans(path):
    """{leaf name: (start, stop)} of each packed leaf's bytes in the pack file."""
    leaves = oeqx.metadata(path).leaves
    return {
        n: (r.offset, r.offset + r.nbytes)
        for n, r in leaves.items()
        if r.data == "packed"
    }


def _stored_spans(path, item):
    """{leaf name: (file, start, stop)}: where the bytes of each Orbax-stored leaf
    that a restore reads are (uncompressed, so found verbatim). Orbax may keep
    more than one copy (per-process OCDBT files and the merged ones); the one a
    restore reads is the one whose flipped bit shows in the restored value."""
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(path)
        for f in names
        if f != "orbax_eqx.json"
    ]
    spans = {}
    for name, record in oeqx.metadata(path).leaves.items():
        if record.data != "orbax":
            continue
        raw = _raw(item[name])
        for file in files:
            start = Path(file).read_bytes().find(raw)
            if start < 0:
                continue
            _flip(file, start, 0)
            try:
                value = oeqx.restore(path, verify=False)[name]
            except oeqx.CheckpointDamagedError:  # a copy checked by OCDBT itself
                value = item[name]
            finally:
                _flip(file, start, 0)
            if _raw(value) != raw:
                spans[name] = (file, start, start + len(raw))
    return spans


def _raw(x) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


# After a failed read, a TensorStore read that Orbax abandoned may finish after
# Orbax closed its event loop, or Orbax leaves the other reads' coroutines
# unawaited, and Python reports them when they are collected: as unraisable,
# from a TensorStore thread or during whichever test runs then. Noise only
# (Orbax's, not ours): the restore has raised.
ORBAX_LATE_READS = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


# --- flipped bits -----------------------------------------------------------------


def test_verify_passes_a_sound_checkpoint_and_counts_its_bytes(tmp_path):
    oeqx.save(tmp_path / "c", _item())
    report = oeqx.verify(tmp_path / "c")
    assert report.ok and not report.damaged and not report.unchecked
    assert sorted(report.checked) == ["b16", "ids", "keys", "mask", "np", "w"]
    assert report.nbytes == oeqx.metadata(tmp_path / "c").nbytes


def test_every_single_bit_flip_in_packed_data_is_caught(tmp_path):
    path = tmp_path / "c"
    item = _item()
    oeqx.save(path, item)
    spans = _packed_spans(path)
    rng = random.Random(1234)
    caught = 0
    for _ in range(FLIPS_PACKED):
        name = rng.choice(sorted(spans))
        start, stop = spans[name]
        byte, bit = rng.randrange(start, stop), rng.randrange(8)
        _flip(_pack(path), byte, bit)
        report = oeqx.verify(path)
        assert [d.name for d in report.damaged] == [name]
        assert "does not match its XXH3-64" in report.damaged[0].problem
        with pytest.raises(oeqx.CheckpointDamagedError) as info:
            oeqx.restore(path, _skeleton())
        assert f"`['{name}']` ({name}): XXH3-64 recorded at save" in str(info.value)
        caught += 1
        _flip(_pack(path), byte, bit)  # undo
    assert caught == FLIPS_PACKED
    assert oeqx.verify(path).ok
    zoo.assert_same(oeqx.restore(path, _skeleton()), item)


@ORBAX_LATE_READS
@pytest.mark.slow
def test_every_single_bit_flip_in_orbax_stored_data_is_caught(tmp_path):
    path = tmp_path / "c"
    item = _item()
    oeqx.save(path, item, pack=False)
    spans = _stored_spans(path, item)
    assert sorted(spans) == ["b16", "ids", "keys", "mask", "np", "w"]
    rng = random.Random(4321)
    for _ in range(FLIPS_STORED):
        name = rng.choice(sorted(spans))
        file, start, stop = spans[name]
        byte, bit = rng.randrange(start, stop), rng.randrange(8)
        _flip(file, byte, bit)
        report = oeqx.verify(path)
        assert [d.name for d in report.damaged] == [name], report
        problem = report.damaged[0].problem
        with pytest.raises(oeqx.CheckpointDamagedError) as info:
            oeqx.restore(path, _skeleton())
        if "Invalid bool value" in problem:
            # TensorStore itself refuses a bool byte other than 0 or 1.
            assert problem.startswith("cannot be read")
            assert "Invalid bool value" in str(info.value)
            assert "from Orbax's array store of the checkpoint" in str(info.value)
        else:
            assert "does not match its sum32" in problem, problem
            assert f"`['{name}']` ({name}): sum32 recorded at" in str(info.value)
        _flip(file, byte, bit)
    assert oeqx.verify(path).ok
    zoo.assert_same(oeqx.restore(path, _skeleton()), item)


def test_a_flat_restore_and_a_partial_restore_check_what_they_read(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, _item())
    start, _ = _packed_spans(path)["w"]
    _flip(_pack(path), start + 5, 0)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"`\['w'\]` \(w\): XXH3-64"):
        oeqx.restore(path)
    # Leaves other than the damaged one still restore.
    part = oeqx.restore(path, {"ids": _skeleton()["ids"]}, strict=False)
    assert part["ids"].shape == (330,)


def test_verify_false_restores_unchecked(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, _item())
    start, _ = _packed_spans(path)["ids"]
    _flip(_pack(path), start, 0)
    restored = oeqx.restore(path, _skeleton(), verify=False)
    saved = _item()
    assert int(restored["ids"][0]) == int(saved["ids"][0]) ^ 1


def test_a_bool_byte_other_than_0_and_1_is_damage_even_unchecked(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, _item())
    start, _ = _packed_spans(path)["mask"]
    _flip(_pack(path), start + 3, 2)  # 0 or 1 becomes 4 or 5
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=r"`\['mask'\]` \(mask\): XXH3"
    ):
        oeqx.restore(path, _skeleton())
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"^Some bool leaves of the checkpoint in \S+ hold bytes other than 0 "
        r"and 1, which no save writes \(a damaged copy\):\n  - Leaf `\['mask'\]` "
        r"\(mask\) holds 1 byte other than 0 and 1\.\nRestore an earlier step",
    ):
        oeqx.restore(path, _skeleton(), verify=False)


def test_checkpoints_without_checksums_are_read_and_reported_unchecked(tmp_path):
    # Saved so on purpose, and said so: no damage, nothing bound to the data.
    path = tmp_path / "c"
    oeqx.save(path, _item(), checksums=False)
    sidecar = json.loads((path / "orbax_eqx.json").read_text())
    assert sidecar["checksums"] is False and oeqx.metadata(path).checksums is False
    assert not any(
        "crc32" in r or "xxh3" in r or "sum32" in r for r in sidecar["leaves"].values()
    )
    report = oeqx.verify(path)
    assert report.ok and not report.checked
    assert sorted(report.unchecked) == ["b16", "ids", "keys", "mask", "np", "w"]
    zoo.assert_same(oeqx.restore(path, _skeleton()), _item())


# `sum32` of (arange(-20, 15).reshape(5, 7) * 3) in each dtype, as orbax_eqx
# 0.1 computed it on the device: checkpoints it wrote still verify.
SUM32 = {
    "float32": 0x51140000,
    "bfloat16": 0x1F75114,
    "float16": 0x22A88A0,
    "int8": 0x1B89B,
    "uint32": 0x289B,
    "bool": 0x4A0,
    "int4": 0x262CB,
    "complex64": 0xE88C0000,
}


@pytest.mark.parametrize("dtype", list(SUM32))
def test_host_sums_are_those_recorded_before(tmp_path, dtype):
    x = (jnp.arange(-20, 15).reshape(5, 7) * 3).astype(dtype)
    oeqx.save(tmp_path / "ckpt", {"x": x}, pack=False)
    assert oeqx.metadata(tmp_path / "ckpt").leaves["x"].sum32 == SUM32[dtype]
    oeqx.verify(tmp_path / "ckpt")


# --- a pack file of the wrong size ------------------------------------------------


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"model": eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)), "n": 3})
    return path


def _damaged_pack(what):
    return (
        rf"The pack file \S+/orbax_eqx~packed\.[0-9a-f]{{16}}\.0\.bin {what}: the "
        r"checkpoint is damaged \(a copy cut short, or a file deleted\)\. Restore an "
        r"earlier step, or re-save it\."
    )


def test_verify_reports_unreadable_data_per_leaf(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, _item())
    spans = _packed_spans(path)
    cut = spans["ids"][0]
    os.truncate(_pack(path), cut)
    report = oeqx.verify(path)
    damaged = {d.name: d.problem for d in report.damaged}
    assert sorted(damaged) == sorted(n for n, (_, stop) in spans.items() if stop > cut)
    assert sorted(report.checked) == sorted(set(spans) - set(damaged))
    assert f"has {cut} bytes where" in damaged["ids"]


def test_pack_longer_than_written_is_damaged(tmp_path):
    path = _checkpoint(tmp_path)
    written = oeqx.metadata(path).packs[0].nbytes
    with open(_pack(path), "ab") as f:
        f.write(b"\0" * 100)
    message = _damaged_pack(f"has {written + 100} bytes where {written} were written")
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(path)
    assert all(re.fullmatch(message, d.problem) for d in oeqx.verify(path).damaged)


WINDOW = 8 << 20  # `max_staged_bytes`: CPU devices copy through it


def _staged_pack(tmp_path):
    """A checkpoint, restored whole through a staging window (`WINDOW`: as on
    an accelerator), and its pack file."""
    path = _checkpoint(tmp_path)
    oeqx.restore(path, max_staged_bytes=WINDOW)
    return path, _pack(path)


@pytest.mark.parametrize("change", [100, -100], ids=["longer", "shorter"])
def test_staged_restore_of_a_pack_not_as_written_is_damaged(tmp_path, change):
    path, pack = _staged_pack(tmp_path)
    saved = oeqx.metadata(path)
    written = saved.packs[0].nbytes
    with open(pack, "r+b") as f:
        f.truncate(written + change)
    # Longer than the sidecar records; or too short for the leaves' bytes.
    needed = max(r.offset + r.nbytes for r in saved.leaves.values() if r.pack == 0)
    if change < 0:
        assert written + change < needed  # the last leaf is cut
    expected = written if change > 0 else needed
    message = _damaged_pack(
        f"has {written + change} bytes where {expected} were written"
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(path, max_staged_bytes=WINDOW)


# --- Orbax's array store damaged --------------------------------------------------


def _unpacked(tmp_path, **options):
    """A checkpoint whose arrays are all in Orbax's array store."""
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    oeqx.save(path, item, pack=False, **options)
    return path, item


def _store(path):
    """The directory of the checkpoint's Orbax array store."""
    return path / f"orbax_eqx~arrays.{oeqx.metadata(path).token}"


def _delete_data_files(path):
    for dirpath, _, filenames in os.walk(path):
        if os.path.basename(dirpath) == "d":
            for name in filenames:
                os.unlink(os.path.join(dirpath, name))


def _truncate_data_files(path):
    for dirpath, _, filenames in os.walk(path):
        if os.path.basename(dirpath) == "d":
            for name in filenames:
                full = os.path.join(dirpath, name)
                os.truncate(full, os.path.getsize(full) // 2)


def _truncate_one_chunk(path):
    # The largest data file holds the array chunks; its index is intact.
    files = [
        os.path.join(dirpath, name)
        for dirpath, _, filenames in os.walk(path)
        if os.path.basename(dirpath) == "d"
        for name in filenames
    ]
    biggest = max(files, key=os.path.getsize)
    os.truncate(biggest, os.path.getsize(biggest) // 2)


@ORBAX_LATE_READS
@pytest.mark.parametrize(
    "damage, match",
    [
        (
            lambda p: (_store(p) / "manifest.ocdbt").unlink(),
            r"Leaf `\['a'\]` \(leaf name `a`\) is stored in Orbax's array store, says "
            r"the sidecar, but the store holds no array under key `a`",
        ),
        (
            _delete_data_files,
            r"Orbax's array store of the checkpoint at .*ckpt\S* cannot be read "
            r"\(NOT_FOUND: .*\): the checkpoint is damaged",
        ),
        (
            _truncate_data_files,
            r"Orbax's array store of the checkpoint at .*ckpt\S* cannot be read "
            r"\(OUT_OF_RANGE: .*\): the checkpoint is damaged",
        ),
        (
            _truncate_one_chunk,
            r"Reading leaves `\['a'\]` \(a\); `\['b'\]` \(b\) from Orbax's array "
            r"store of the checkpoint at .*ckpt\S* failed \(OUT_OF_RANGE: Error "
            r'reading "a/0" .*\): the checkpoint is damaged',
        ),
        (
            lambda p: shutil.rmtree(_store(p) / "ocdbt.process_0"),
            r"Reading leaves `\['a'\]` \(a\); `\['b'\]` \(b\) from Orbax's array "
            r"store of the checkpoint at .*ckpt\S* failed \(.*\): the checkpoint is "
            r"damaged",
        ),
    ],
    ids=[
        "manifest_deleted",
        "data_files_deleted",
        "data_files_truncated",
        "chunk_file_truncated",
        "process_tree_deleted",
    ],
)
@pytest.mark.slow
def test_damaged_orbax_store(tmp_path, damage, match):
    path, item = _unpacked(tmp_path)
    damage(path)
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"(?s){match}.*Restore an "
        r"earlier step, or re-save the checkpoint[.;]",
    )
    skeleton = eqx.filter_eval_shape(lambda: item)
    fails_touching_nothing(tmp_path, path, oeqx.CheckpointDamagedError, match, skeleton)
    gc.collect()  # Orbax's unawaited coroutines: reported here, where ignored


@ORBAX_LATE_READS
@pytest.mark.slow
def test_damaged_orbax_error_keeps_orbax_details_as_the_cause(tmp_path):
    path, _ = _unpacked(tmp_path)
    shutil.rmtree(_store(path) / "ocdbt.process_0")
    with pytest.raises(oeqx.CheckpointDamagedError) as info:
        oeqx.restore(path)
    assert info.value.__cause__ is not None
    assert len(str(info.value)) < 1000  # not Orbax's pages of TensorStore spec
    del info
    gc.collect()


@ORBAX_LATE_READS
def test_verify_reports_missing_orbax_files(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, {"w": jnp.ones((64, 64))}, pack=False)
    for d in [root for root, _, _ in os.walk(path) if os.path.basename(root) == "d"]:
        shutil.rmtree(d)
    report = oeqx.verify(path)
    assert [d.name for d in report.damaged] == ["w"]
    assert report.damaged[0].problem.startswith("cannot be read")
