"""Every record of the sidecar is bound, and none can be edited unseen.

Format 6 ends the sidecar with a checksum of every byte before it: a one-bit
edit of any record (a Python value, an alias, a `Shared` wiring, a static
field, the pack table) is damage to every reader: a restore (flat, into a
skeleton, rebuilt), `metadata`, `verify` and `python -m orbax_eqx
verify`, and `restore_latest` falls back past it. Before format 6 such an
edit changed a restored value silently (`tests/test_old_formats.py` keeps a
format-5 checkpoint to show it).

From format 5 on, each packed leaf's data checksum is also bound to its
record (XOR the checksum of the save's token, leaf name, dtype, shape, pack
file, offset and size), so that an edit that keeps the sizes consistent and
the file resealed (a dtype of the same width, a reshape, another leaf's
offset, swapped records, another save's pack) is found by a restore and by
`verify` alike, never restored as wrong values. A packed leaf that lost its
checksum is damage to both.
"""

import json
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx
from orbax_eqx._format.checksum import DIGEST, digest
from orbax_eqx._format.sidecar import FILE_NAME, FORMAT_VERSION
from orbax_eqx._tools.cli import main as cli_main

# --- format 6: the checksum line over every byte -----------------------------

KEY = jax.random.key(0)

_DAMAGED = (
    r"The sidecar \S+/orbax_eqx\.json does not match its checksum "
    r"\(xxh3:[0-9a-f]{16} recorded, xxh3:[0-9a-f]{16} computed now\): it changed "
    r"after the save \(a flipped bit, a damaged copy, or an edit\); the checkpoint "
    r"is damaged \(or something else was put in its place\)\. Restore an earlier "
    r"step, or re-save it\."
)


class Scaled(eqx.Module):
    weight: jax.Array
    heads: int = eqx.field(static=True)


def _item():
    tied = np.arange(6, dtype=np.float32)
    return {
        "step": 100,
        "model": Scaled(jnp.ones(3), 4),
        "tied_a": tied,
        "tied_b": tied,
        "tied_c": np.arange(6, dtype=np.float32) + 1,  # what an edit could tie
    }


def _flip(path, old: str, new: str) -> None:
    """Edits the sidecar's text without resealing it: `old` and `new` differ
    in one bit."""
    (bit,) = [a ^ b for a, b in zip(old.encode(), new.encode(), strict=True) if a != b]
    assert bin(bit).count("1") == 1 and len(old) == len(new)
    text = (path / FILE_NAME).read_text()
    assert text.count(old) == 1, old
    (path / FILE_NAME).write_text(text.replace(old, new))


_EDITS = {
    "python-value": ('"value": 100', '"value": 101'),
    "static-field": ('"heads": 4', '"heads": 5'),
    "alias": ('"alias_of": "tied_a"', '"alias_of": "tied_c"'),
    "pack-table": ('"alignment": 64', '"alignment": 65'),
    "format-version": ('"format_version": 6', '"format_version": 7'),
}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item())
    return path


@pytest.mark.parametrize("old, new", _EDITS.values(), ids=_EDITS.keys())
def test_a_one_bit_edit_is_damage_to_every_reader(saved, capsys, old, new):
    _flip(saved, old, new)
    skeleton = jax.tree.map(np.zeros_like, _item())
    readers = [
        lambda: oeqx.restore(saved),
        lambda: oeqx.restore(saved, skeleton),
        lambda: oeqx.restore(saved, allow=["equinox", "test_sealed_records"]),
        lambda: oeqx.metadata(saved),
        lambda: oeqx.verify(saved),
    ]
    for read in readers:
        with pytest.raises(oeqx.SidecarError, match=_DAMAGED):
            read()
    assert cli_main(["verify", str(saved)]) == 2
    assert re.fullmatch(f"orbax_eqx: error: {_DAMAGED}\n", capsys.readouterr().err)
    assert cli_main(["inspect", str(saved)]) == 2


def test_a_shared_wiring_edit_is_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, zoo.shared_tied(KEY))
    _flip(
        path,
        '"where": {"many": false, "paths": [[["index", 1]',
        ('"where": {"many": false, "paths": [[["index", 0]'),
    )
    with pytest.raises(oeqx.SidecarError, match=_DAMAGED):
        oeqx.restore(path, allow=["equinox", "zoo"])


@pytest.mark.slow
def test_every_single_bit_flip_is_damage(saved):
    # Bit 0 and bit 5 of every byte, one at a time: the JSON, the records,
    # the checksum line itself. Whatever breaks, it is a `SidecarError`.
    data = (saved / FILE_NAME).read_bytes()
    for at in range(len(data)):
        for bit in (0x01, 0x20):
            flipped = bytearray(data)
            flipped[at] ^= bit
            (saved / FILE_NAME).write_bytes(bytes(flipped))
            with pytest.raises(oeqx.SidecarError):
                oeqx.metadata(saved)
    (saved / FILE_NAME).write_bytes(data)
    assert oeqx.metadata(saved).format_version == FORMAT_VERSION == 6


def test_the_checksum_is_the_last_line_and_covers_every_byte_before_it(saved):
    data = (saved / FILE_NAME).read_bytes()
    *lines, last, end, nothing = data.split(b"\n")
    assert (end, nothing) == (b"}", b"")
    body = b"\n".join(lines) + b"\n"
    recorded = json.loads(b"{" + last + b"}")["checksum"]
    assert recorded == digest(body) and recorded.startswith(f"{DIGEST}:")
    assert json.loads(data)["checksum"] == recorded


@pytest.mark.parametrize(
    "rewrite, what",
    [
        (
            lambda text: json.dumps(json.loads(text), indent=1),
            r"records no checksum on its last line, where a format-6 sidecar always "
            r"has one: it was edited, or rewritten",
        ),
        (
            lambda text: json.dumps(
                {k: v for k, v in json.loads(text).items() if k != "checksum"}
            ),
            r"records no checksum on its last line, where a format-6 sidecar always "
            r"has one",
        ),
        (
            lambda text: re.sub(r'"xxh3:[0-9a-f]{16}"', '"md5:0123456789abcdef"', text),
            r"records a checksum of unknown checksum algorithm 'md5' \(this "
            r"orbax_eqx knows crc32, xxh3\)",
        ),
    ],
    ids=["reformatted", "checksum-removed", "unknown-algorithm"],
)
def test_a_sidecar_without_a_checksum_it_can_check_is_damage(saved, rewrite, what):
    text = (saved / FILE_NAME).read_text()
    (saved / FILE_NAME).write_text(rewrite(text))
    with pytest.raises(oeqx.SidecarError, match=rf"orbax_eqx\.json {what}"):
        oeqx.metadata(saved)


def test_restore_latest_falls_back_past_an_edited_sidecar(tmp_path):
    with ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler()) as mngr:
        for step in (1, 2):
            mngr.save(step, args=oeqx.EqxSave({"step": 100 + step}))
        mngr.wait_until_finished()
        _flip(tmp_path / "2" / "default", '"value": 102', '"value": 103')
        with pytest.warns(oeqx.FallbackWarning, match=r"does not match its checksum"):
            step, item = oeqx.restore_latest(mngr, oeqx.EqxRestore())
    assert (step, item) == (1, {"step": 101})


# --- format 5 on: packed leaves' checksums bound to their records -----------

PACKED_ITEM = {
    "a": np.arange(6, dtype=np.float32),
    "b": np.arange(6, dtype=np.float32) + 10,
    "c": np.arange(3.0),
}


@pytest.fixture
def bound_ckpt(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, PACKED_ITEM)
    return path


def _resealed(path, change):
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
def test_edited_records_are_damage_to_restore_and_verify(bound_ckpt, change, damaged):
    _resealed(bound_ckpt, change)
    report = oeqx.verify(bound_ckpt)
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
        oeqx.restore(bound_ckpt)  # flat: no skeleton to disagree with the record
    # A skeleton that agrees with the edited record reads the data and finds it.
    meta = oeqx.metadata(bound_ckpt)
    skeleton = {
        name: np.zeros(leaf.shape, leaf.dtype) for name, leaf in meta.leaves.items()
    }
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded at"):
        oeqx.restore(bound_ckpt, skeleton)
    # Leaves not edited still restore alone.
    intact = [n for n in PACKED_ITEM if n not in damaged]
    restored = oeqx.restore(
        bound_ckpt, {n: PACKED_ITEM[n] for n in intact}, strict=False
    )
    for n in intact:
        assert restored[n].tobytes() == PACKED_ITEM[n].tobytes()


def test_a_pack_of_another_save_under_this_token_is_damage(tmp_path, bound_ckpt):
    other = tmp_path / "other"
    oeqx.save(other, {n: x + 1 for n, x in PACKED_ITEM.items()})
    (mine,) = bound_ckpt.glob("orbax_eqx~packed.*.bin")
    (theirs,) = other.glob("orbax_eqx~packed.*.bin")
    shutil.copyfile(theirs, mine)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded"):
        oeqx.restore(bound_ckpt, PACKED_ITEM)
    assert sorted(d.name for d in oeqx.verify(bound_ckpt).damaged) == ["a", "b", "c"]


def test_a_sidecar_with_an_edited_token_is_damage(bound_ckpt):
    old = sidecars.read(bound_ckpt)["token"]
    new = "0123456789abcdef"
    (pack,) = bound_ckpt.glob("orbax_eqx~packed.*.bin")
    pack.rename(bound_ckpt / pack.name.replace(old, new))

    def change(c):
        c["token"] = new
        c["packs"][0]["file"] = c["packs"][0]["file"].replace(old, new)

    _resealed(bound_ckpt, change)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded"):
        oeqx.restore(bound_ckpt, PACKED_ITEM)
    assert sorted(d.name for d in oeqx.verify(bound_ckpt).damaged) == ["a", "b", "c"]


@pytest.mark.parametrize("leaf", ["a", "c"])
def test_a_packed_leaf_without_its_crc_is_damage_to_restore_and_verify(
    bound_ckpt, leaf
):
    def change(c):
        del c["leaves"][leaf]["xxh3"]

    _resealed(bound_ckpt, change)
    match = (
        rf"The sidecar in \S+ is damaged: leaf `\['{leaf}'\]` \(leaf name '{leaf}'\) "
        r"is packed but records no XXH3-64, though a format-6 sidecar of a save "
        r"with checksums records one for every such leaf: it was edited\. "
        r"Restore an earlier step, or re-save the checkpoint\."
    )
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.restore(bound_ckpt, PACKED_ITEM)
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.verify(bound_ckpt)


def test_without_checksums_nothing_is_bound(tmp_path):
    oeqx.save(tmp_path / "ckpt", PACKED_ITEM, checksums=False)
    content = json.loads((tmp_path / "ckpt" / "orbax_eqx.json").read_text())
    assert all("xxh3" not in leaf for leaf in content["leaves"].values())
    restored = oeqx.restore(tmp_path / "ckpt", PACKED_ITEM)
    assert all(restored[n].tobytes() == PACKED_ITEM[n].tobytes() for n in PACKED_ITEM)
    report = oeqx.verify(tmp_path / "ckpt")
    assert report.ok and sorted(report.unchecked) == ["a", "b", "c"]
