"""Sidecar records of packed leaves are bound to their data and the save.

Format 5 records each packed leaf's CRC-32 XOR the CRC-32 of its record, format
6 its XXH3-64 XOR the XXH3-64 of its record (the
save's token, leaf name, dtype, shape, pack file, offset, size), so that an
edit to any of these that keeps the sizes consistent (a dtype of the same
width, a reshape, another leaf's offset, swapped records, another save's pack)
is found by a restore and by `verify` alike, never restored as wrong values.
A packed leaf that lost its CRC-32 is damage to both.
"""

import json
import shutil

import numpy as np
import pytest
import sidecars

import orbax_eqx as oeqx

ITEM = {
    "a": np.arange(6, dtype=np.float32),
    "b": np.arange(6, dtype=np.float32) + 10,
    "c": np.arange(3.0),
}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, ITEM)
    return path


def _edit(path, change):
    sidecars.edit(path, change)  # resealed: the CRC-32s must find the edit


def _dtype(c):
    c["leaves"]["a"]["dtype"] = "int32"


def _shape(c):
    c["leaves"]["a"]["shape"] = [2, 3]


def _offset(c):  # `a` pointing at `b`'s bytes, with `b`'s CRC-32
    for key in ("offset", "xxh3"):
        c["leaves"]["a"][key] = c["leaves"]["b"][key]


def _swap(c):  # `a` and `b` swap where their bytes are, each keeping its CRC
    a, b = c["leaves"]["a"], c["leaves"]["b"]
    for key in ("offset", "xxh3"):
        a[key], b[key] = b[key], a[key]


def _unsigned(c):
    c["leaves"]["c"]["dtype"] = "uint64"


@pytest.mark.parametrize(
    "change, damaged",
    [
        (_dtype, ["a"]),
        (_shape, ["a"]),
        (_offset, ["a"]),
        (_swap, ["a", "b"]),
        (_unsigned, ["c"]),
    ],
    ids=["dtype", "shape", "offset", "swapped", "dtype-of-float64"],
)
def test_edited_records_are_damage_to_restore_and_verify(saved, change, damaged):
    _edit(saved, change)
    report = oeqx.verify(saved)
    assert sorted(d.name for d in report.damaged) == damaged
    for d in report.damaged:
        assert d.problem.endswith(
            "(or its sidecar record was edited: dtype, shape, offset)"
        )
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=r"changed after it was saved \(a flipped bit on disk, or a damaged "
        r"copy; or its sidecar record was edited\):\n  - Leaf `\['"
        + damaged[-1]
        + r"'\]`",
    ):
        oeqx.restore(saved)  # flat: no skeleton to disagree with the record
    # A skeleton that agrees with the edited record reads the data and finds it.
    meta = oeqx.metadata(saved)
    skeleton = {
        name: np.zeros(leaf.shape, leaf.dtype) for name, leaf in meta.leaves.items()
    }
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded at"):
        oeqx.restore(saved, skeleton)
    # Leaves not edited still restore alone.
    intact = [n for n in ITEM if n not in damaged]
    restored = oeqx.restore(saved, {n: ITEM[n] for n in intact}, strict=False)
    for n in intact:
        assert restored[n].tobytes() == ITEM[n].tobytes()


def test_a_pack_of_another_save_under_this_token_is_damage(tmp_path, saved):
    other = tmp_path / "other"
    oeqx.save(other, {n: x + 1 for n, x in ITEM.items()})
    (mine,) = saved.glob("orbax_eqx~packed.*.bin")
    (theirs,) = other.glob("orbax_eqx~packed.*.bin")
    shutil.copyfile(theirs, mine)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded"):
        oeqx.restore(saved, ITEM)
    assert sorted(d.name for d in oeqx.verify(saved).damaged) == ["a", "b", "c"]


def test_a_sidecar_with_an_edited_token_is_damage(saved):
    old = sidecars.read(saved)["token"]
    new = "0123456789abcdef"
    (pack,) = saved.glob("orbax_eqx~packed.*.bin")
    pack.rename(saved / pack.name.replace(old, new))

    def change(c):
        c["token"] = new
        c["packs"][0]["file"] = c["packs"][0]["file"].replace(old, new)

    _edit(saved, change)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded"):
        oeqx.restore(saved, ITEM)
    assert sorted(d.name for d in oeqx.verify(saved).damaged) == ["a", "b", "c"]


@pytest.mark.parametrize("leaf", ["a", "c"])
def test_a_packed_leaf_without_its_crc_is_damage_to_restore_and_verify(saved, leaf):
    def change(c):
        del c["leaves"][leaf]["xxh3"]

    _edit(saved, change)
    match = (
        rf"The sidecar in \S+ is damaged: leaf `\['{leaf}'\]` \(leaf name '{leaf}'\) "
        r"is packed but records no XXH3-64, though a format-6 sidecar of a save "
        r"with checksums records one for every such leaf: it was edited\. "
        r"Restore an earlier step, or re-save the checkpoint\."
    )
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.restore(saved, ITEM)
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.verify(saved)


def test_without_checksums_nothing_is_bound(tmp_path):
    oeqx.save(tmp_path / "ckpt", ITEM, checksums=False)
    content = json.loads((tmp_path / "ckpt" / "orbax_eqx.json").read_text())
    assert all("xxh3" not in leaf for leaf in content["leaves"].values())
    restored = oeqx.restore(tmp_path / "ckpt", ITEM)
    assert all(restored[n].tobytes() == ITEM[n].tobytes() for n in ITEM)
    report = oeqx.verify(tmp_path / "ckpt")
    assert report.ok and sorted(report.unchecked) == ["a", "b", "c"]
