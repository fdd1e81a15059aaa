"""Checksums: every flipped bit of array data is found by `verify` and refused
by restore, for packed arrays and for arrays stored through Orbax alike."""

import json
import os
import random
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import orbax_eqx as oeqx
from orbax_eqx._format.checksum import host_sum32


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


# After a failed read, a TensorStore read that Orbax abandoned may finish after
# Orbax closed its event loop; Python then reports "Event loop is closed" as
# unraisable, from a TensorStore thread. Noise only: the restore has raised.
ORBAX_LATE_READS = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


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
            assert "does not match its sum32" in problem
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


def test_checkpoints_without_checksums_are_read_and_reported_unchecked(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, _item(), checksums=False)
    sidecar = json.loads((path / "orbax_eqx.json").read_text())
    assert not any(
        "crc32" in r or "xxh3" in r or "sum32" in r for r in sidecar["leaves"].values()
    )
    report = oeqx.verify(path)
    assert report.ok and not report.checked
    assert sorted(report.unchecked) == ["b16", "ids", "keys", "mask", "np", "w"]
    zoo.assert_same(oeqx.restore(path, _skeleton()), _item())


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


@ORBAX_LATE_READS
def test_verify_reports_missing_orbax_files(tmp_path):
    path = tmp_path / "c"
    oeqx.save(path, {"w": jnp.ones((64, 64))}, pack=False)
    for d in [root for root, _, _ in os.walk(path) if os.path.basename(root) == "d"]:
        shutil.rmtree(d)
    report = oeqx.verify(path)
    assert [d.name for d in report.damaged] == ["w"]
    assert report.damaged[0].problem.startswith("cannot be read")


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
def test_host_sums_are_those_recorded_before(dtype):
    x = (jnp.arange(-20, 15).reshape(5, 7) * 3).astype(dtype)
    assert host_sum32(np.asarray(x)) == SUM32[dtype]
