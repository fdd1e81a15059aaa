"""The data checksums of a sidecar's records, edited (resealed, as an
attacker would: `tests/sidecars.py`).

Format 5 records each packed leaf's CRC-32 XOR the CRC-32 of its record, format
6 its XXH3-64 XOR the XXH3-64 of its record (the save's token, leaf name,
dtype, shape, pack file, offset, size), so that an edit to any of these that
keeps the sizes consistent (a dtype of the same width, a reshape, another
leaf's offset, swapped records, another save's pack) is found by a restore and
by `verify` alike, never restored as wrong values. Checksums stripped from a
sidecar that says it has them are damage; a sidecar of a format that did not
say so is read, unchecked.
"""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
from entry import main

import orbax_eqx as oeqx
from orbax_eqx._format import checksum

SIDECAR = "orbax_eqx.json"

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


def _damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


# --- records bound to their data --------------------------------------------------


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


# --- checksums stripped -----------------------------------------------------------


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_stripped_checksums_are_damage(tmp_path, capsys, pack):
    # Restore and verify agree: the sidecar is damaged (format 5).
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0), "b": jnp.ones(3)}, pack=pack)

    def strip(content):
        for record in content["leaves"].values():
            record.pop("xxh3" if pack else "sum32")

    _edit(path, strip)
    where, kind = (
        ("is packed", "XXH3-64")
        if pack
        else (
            "is in Orbax's array store",
            "sum32",
        )
    )
    match = _damaged(
        rf"leaf `\['a'\]` \(leaf name 'a'\) {where} but records no {kind}, though "
        r"a format-6 sidecar of a save with checksums records one for every such "
        r"leaf: it was edited"
    )
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.verify(path)
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.restore(path, {"a": jnp.zeros(10), "b": jnp.zeros(3)})
    assert main(["verify", str(path)]) != 0
    assert "records no" in capsys.readouterr().err


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "orbax"])
def test_stripped_checksums_of_format_4_are_damage_to_verify(tmp_path, capsys, pack):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0), "b": jnp.ones(3)}, pack=pack)

    def strip(content):
        content["format_version"] = 4
        for record in content["leaves"].values():
            record.pop("xxh3" if pack else "sum32")  # (format 4 has "crc32")

    _edit(path, strip)
    if pack:  # packed leaves always have one: the sidecar is damaged
        with pytest.raises(oeqx.SidecarError, match=r"format-4 sidecar"):
            oeqx.verify(path)
        return
    report = oeqx.verify(path)
    assert not report.ok and report.unchecked == ()
    assert sorted(d.name for d in report.damaged) == ["a", "b"]
    for leaf in report.damaged:
        assert leaf.problem == (
            "records no checksum, though a format-4 sidecar records "
            "one for every array unless saved with checksums=False, which this one "
            "does not say: its sidecar was edited or damaged"
        )
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED `a`: records no checksum, though a format-4" in out


def test_a_format_3_sidecar_without_checksums_is_unchecked_not_damaged(
    tmp_path, capsys
):
    # Format 3 did not record `checksums=False`: a sidecar without checksums
    # may be a sound checkpoint saved so, which `verify` must not call damaged.
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)

    def as_format_3(content):
        content.update(format_version=3)
        content.pop("checksums")
        content.pop("shard_files")

    _edit(path, as_format_3)
    report = oeqx.verify(path)
    assert report.ok and report.unchecked == ("a",)
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "1 leaves record no checksum (a format-3 sidecar has a checksum for every "
        "array unless saved with checksums=False, which it does not record): read, "
        "not checked."
    )


def test_a_format_2_sidecar_without_checksums_may_predate_them(tmp_path, capsys):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)

    pack = path / oeqx.metadata(path).packs[0].file
    pack.rename(path / "orbax_eqx~packed.0.bin")  # format 2's name: no token

    def as_format_2(content):
        content.update(format_version=2)
        for key in ("checksums", "shard_files", "token"):
            content.pop(key)
        content["packs"][0]["file"] = "orbax_eqx~packed.0.bin"

    _edit(path, as_format_2)
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "1 leaves record no checksum (saved with checksums=False, or by an "
        "orbax_eqx from before checksums): read, not checked."
    )


def test_checksums_flag_that_is_no_bool_is_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)
    _edit(path, lambda c: c.update(checksums="no"))
    with pytest.raises(
        oeqx.SidecarError, match=_damaged('"checksums" must be true or false')
    ):
        oeqx.verify(path)


# Private on purpose: the text a record's binding sums is written out by
# hand for speed, and must be, byte for byte, what the JSON encoder writes.
@pytest.mark.parametrize(
    "name",
    ["w", 'q"uote', "back\\slash", "tab\tnew\nline\x01", "ünï€😀", "lone\udc80", ""],
)
@pytest.mark.parametrize("shape", [[], [3], [2, 0, 5]])
def test_the_bound_text_is_what_the_json_encoder_writes(name, shape):
    import json

    from orbax_eqx._format.binding import Binder

    binder = Binder("0123456789abcdef")
    where = ["0123456789abcdef", name, "bfloat16", shape, "pack.bin", 64, 2**40]
    expected = json.dumps(where, ensure_ascii=False, separators=(",", ":"))
    assert binder.text(*where[1:]) == expected
    assert binder.text(*where[1:]) == expected  # the second time from its caches
    # Values of other types than a save records take the encoder's way.
    odd = ["0123456789abcdef", name, "f4", [True, 2], "p", 1.0, False]
    expected = json.dumps(odd, ensure_ascii=False, separators=(",", ":"))
    assert binder.text(*odd[1:]) == expected


@pytest.mark.parametrize(
    "name",
    ["w", 'q"uote', "back\\slash", "tab\tnew\nline\x01", "ünï€😀", "lone\udc80", ""],
    ids=["plain", "quote", "backslash", "controls", "unicode", "surrogate", "empty"],
)
@pytest.mark.parametrize("shape", [(), (3,), (2, 0, 5)], ids=["0d", "1d", "3d"])
@pytest.mark.parametrize("algorithm", ["crc32", "xxh3"])
def test_a_rows_binding_is_the_records(name, shape, algorithm):
    # `Binder.row` writes the text's middle once per dtype and shape: it binds
    # as binding the whole record does, the first time and from its cache,
    # and values of other types than a row holds take the record's way.
    from orbax_eqx._format.binding import Binder, bind
    from orbax_eqx._format.sidecar import pack_file

    token = "0123456789abcdef"
    for dtype in ("bfloat16", "<U2", 'we"ird'):
        record = {"dtype": dtype, "shape": list(shape), "pack": 0}
        record.update(file=pack_file(token, 0), offset=64, nbytes=2**40)
        expected = bind(0x1234, token, name, record, algorithm)
        binder = Binder(token, algorithm)
        for _ in range(2):
            assert binder.row(0x1234, name, dtype, shape, 64, 2**40) == expected
    odd = Binder(token, algorithm)
    record.update(shape=[True, 2], offset=1.0)
    expected = bind(7, token, name, record, algorithm)
    assert odd.row(7, name, record["dtype"], (True, 2), 1.0, 2**40) == expected
    assert odd.row(7, name, "f4", (1, 2), 64, False) == odd(
        7, name, "f4", (1, 2), 0, 64, False
    )


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3"])
@pytest.mark.parametrize(
    "array",
    [
        np.zeros((0, 3), np.float32),
        np.arange(64, dtype=np.float32).reshape(8, 8),
        np.arange(64, dtype=np.int16).reshape(8, 8).T,  # not C-contiguous
        np.random.default_rng(0).standard_normal(300_000),  # pieces of 1 MiB
    ],
    ids=["empty", "small", "transposed", "large"],
)
def test_a_data_checksum_in_one_call_is_the_running_one(algorithm, array):
    # `data_sum` sums in one call what `Running` sums a piece at a time (the
    # pack's checksums and a restore's verification agree).
    running = checksum.Running(algorithm)
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    for start in range(0, max(flat.size, 1), 1 << 20):
        running.update(flat[start : start + (1 << 20)])
    assert checksum.data_sum(array, algorithm) == running.value()
    assert checksum.data_sum(flat.data, algorithm) == running.value()
    with pytest.raises(ValueError, match="unknown data checksum 'md5'"):
        checksum.data_sum(array, "md5")
