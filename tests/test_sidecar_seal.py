"""The sidecar is sealed, and so is every packed leaf's data: a one-bit edit
anywhere in the sidecar, and a data checksum that is another save's, in
another spelling or stripped, is damage to every reader, under Orbax's v1
API too.
"""

import json
import logging
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sidecars
import xxhash
import zoo
from entry import main
from orbax.checkpoint import v1 as ocp_v1

import orbax_eqx as oeqx

# --- the seal ------------------------------------------------------------------
# The sidecar is sealed: its last line is the XXH3-64 of every byte before
# it, and each packed leaf records the XXH3-64 of its data.
#
# A one-bit edit of any record (a Python value, an alias, a `Shared` wiring, a
# static field, the pack table) is damage to every reader: a restore (flat,
# into a skeleton, rebuilt), `metadata`, `verify` and `orbax-eqx verify`, and
# `restore_latest` falls back past it. A data checksum in any other spelling
# is damage.
#
# The sidecar is edited here without resealing (damage); `tests/sidecars.py`
# reseals, for the tests of the reader's rules.


KEY = jax.random.key(0)
FILE_NAME = "orbax_eqx.json"

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
    "format-version": ('"format_version": 7', '"format_version": 6'),
}


@pytest.fixture
def seal_saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item())
    return path


@pytest.mark.parametrize("old, new", _EDITS.values(), ids=_EDITS.keys())
def test_a_one_bit_edit_is_damage_to_every_reader(seal_saved, capsys, old, new):
    _flip(seal_saved, old, new)
    skeleton = jax.tree.map(np.zeros_like, _item())
    readers = [
        lambda: oeqx.restore(seal_saved),
        lambda: oeqx.restore(seal_saved, skeleton),
        lambda: oeqx.restore(seal_saved, allow=["equinox", "test_sidecar_seal"]),
        lambda: oeqx.metadata(seal_saved),
        lambda: oeqx.verify(seal_saved),
    ]
    for read in readers:
        with pytest.raises(oeqx.CheckpointDamagedError, match=_DAMAGED):
            read()
    assert main(["verify", str(seal_saved)]) == 2
    assert re.fullmatch(f"orbax_eqx: error: {_DAMAGED}\n", capsys.readouterr().err)
    assert main(["inspect", str(seal_saved)]) == 2


def test_a_shared_wiring_edit_is_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, zoo.shared_tied(KEY))
    _flip(
        path,
        '"where": {"many": false, "paths": [[["index", 1]',
        ('"where": {"many": false, "paths": [[["index", 0]'),
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=_DAMAGED):
        oeqx.restore(path, allow=["equinox", "zoo"])


@pytest.mark.slow
def test_every_single_bit_flip_is_damage(seal_saved):
    # Bit 0 and bit 5 of every byte, one at a time: the JSON, the records,
    # the checksum line itself. Whatever breaks, it is a `SidecarError`.
    data = (seal_saved / FILE_NAME).read_bytes()
    for at in range(len(data)):
        for bit in (0x01, 0x20):
            flipped = bytearray(data)
            flipped[at] ^= bit
            (seal_saved / FILE_NAME).write_bytes(bytes(flipped))
            with pytest.raises(oeqx.CheckpointDamagedError):
                oeqx.metadata(seal_saved)
    (seal_saved / FILE_NAME).write_bytes(data)
    assert oeqx.metadata(seal_saved).format_version == 7


def test_the_checksum_is_the_last_line_and_covers_every_byte_before_it(seal_saved):
    data = (seal_saved / FILE_NAME).read_bytes()
    *lines, last, end, nothing = data.split(b"\n")
    assert (end, nothing) == (b"}", b"")
    body = b"\n".join(lines) + b"\n"
    recorded = json.loads(b"{" + last + b"}")["checksum"]
    assert recorded == f"xxh3:{xxhash.xxh3_64_hexdigest(body)}"
    assert json.loads(data)["checksum"] == recorded


@pytest.mark.parametrize(
    "rewrite, what",
    [
        (
            lambda text: json.dumps(json.loads(text), indent=1),
            r"records no checksum on its last line, where every sidecar "
            r"has one: it was edited, or rewritten",
        ),
        (
            lambda text: json.dumps(
                {k: v for k, v in json.loads(text).items() if k != "checksum"}
            ),
            r"records no checksum on its last line, where every sidecar "
            r"has one",
        ),
        (
            lambda text: re.sub(r'"xxh3:[0-9a-f]{16}"', '"md5:0123456789abcdef"', text),
            r"records a checksum of another algorithm \(md5:0123456789abcdef\)",
        ),
    ],
    ids=["reformatted", "checksum-removed", "unknown-algorithm"],
)
def test_a_sidecar_without_a_checksum_it_can_check_is_damage(seal_saved, rewrite, what):
    text = (seal_saved / FILE_NAME).read_text()
    (seal_saved / FILE_NAME).write_text(rewrite(text))
    with pytest.raises(oeqx.CheckpointDamagedError, match=rf"orbax_eqx\.json {what}"):
        oeqx.metadata(seal_saved)


def test_restore_latest_falls_back_past_an_edited_sidecar(tmp_path):
    with ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler()) as mngr:
        for step in (1, 2):
            mngr.save(step, args=oeqx.EqxSave({"step": 100 + step}))
        mngr.wait_until_finished()
        _flip(tmp_path / "2" / "default", '"value": 102', '"value": 103')
        with pytest.warns(oeqx.OrbaxEqxWarning, match=r"does not match its checksum"):
            step, item = oeqx.restore_latest(mngr, oeqx.EqxRestore())
    assert (step, item) == (1, {"step": 101})


# --- data checksums ----------------------------------------------------------------


def _seal_damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


def test_a_save_records_xxh3_of_packed_data_and_of_itself(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0), "b": np.ones(3, np.int8)})
    text = (path / FILE_NAME).read_text()
    content = json.loads(text)
    assert content["format_version"] == 7
    row = content["leaves"]["a"]  # a jax array: a row (`compact`)
    assert row[:3] == ["float32", [10], 0] and re.fullmatch(r"[0-9a-f]{16}", row[3])
    record = content["leaves"]["b"]  # a numpy array: whole
    assert re.fullmatch(r"[0-9a-f]{16}", record["xxh3"]) and "crc32" not in record
    assert re.fullmatch(r"xxh3:[0-9a-f]{16}", content["checksum"])
    assert oeqx.verify(path).ok


_NOT_HEX = (
    r"is malformed \(Expected `str` matching regex '\^\[0-9a-f\]\{16\}\$' - at "
    r"`\$\.xxh3`\)"
)


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda r: r.update(xxh3="0x1234"), _NOT_HEX),
        (lambda r: r.update(xxh3="ABCDEF0123456789"), _NOT_HEX),
        (
            lambda r: r.update(xxh3=12345),
            r"is malformed \(Expected `str \| null`, got `int` - at `\$\.xxh3`\)",
        ),
        (lambda r: r.update(xxh3="0" * 99), _NOT_HEX),
    ],
    ids=["prefixed", "upper-case", "integer", "too-long"],
)
def test_a_data_checksum_not_in_16_hex_digits_is_damage(tmp_path, change, what):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)})
    # Resealed: what is probed is the reader's rule for the field.
    sidecars.edit(path, lambda c: change(c["leaves"]["a"]))
    match = _seal_damaged(f"leaf 'a' {what}")
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(path, {"a": jnp.zeros(10)})
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.verify(path)


# --- data checksums, edited and resealed ---------------------------------------
# The data checksums of a sidecar's records, edited (resealed, as an
# attacker would: `tests/sidecars.py`): bytes of another save under this one's
# names are damage; checksums stripped from a sidecar that says it has them are
# damage. (An edit that is not resealed is damage before any record is read:
# the seal, above.)


ITEM = {
    "a": np.arange(6, dtype=np.float32),
    "b": np.arange(6, dtype=np.float32) + 10,
    "c": np.arange(3.0),
}


@pytest.fixture
def sums_saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, ITEM)
    return path


def _edit(path, change):
    sidecars.edit(path, change)  # resealed


def _sums_damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


def test_a_pack_of_another_save_under_this_token_is_damage(tmp_path, sums_saved):
    other = tmp_path / "other"
    oeqx.save(other, {n: x + 1 for n, x in ITEM.items()})
    (mine,) = sums_saved.glob("orbax_eqx~packed.*.bin")
    (theirs,) = other.glob("orbax_eqx~packed.*.bin")
    shutil.copyfile(theirs, mine)
    with pytest.raises(oeqx.CheckpointDamagedError, match=r"XXH3-64 recorded"):
        oeqx.restore(sums_saved, ITEM)
    assert sorted(d.name for d in oeqx.verify(sums_saved).damaged) == ["a", "b", "c"]


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
        ("is packed", "xxh3")
        if pack
        else (
            "is in Orbax's array store",
            "sum32",
        )
    )
    match = _sums_damaged(
        rf"leaf `\['a'\]` \(leaf name 'a'\) {where} but records no {kind}, though "
        r"a save with checksums records one for every such leaf: it was edited"
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.verify(path)
    with pytest.raises(oeqx.CheckpointDamagedError, match=match):
        oeqx.restore(path, {"a": jnp.zeros(10), "b": jnp.zeros(3)})
    assert main(["verify", str(path)]) != 0
    assert "records no" in capsys.readouterr().err


def test_checksums_flag_that_is_no_bool_is_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)
    _edit(path, lambda c: c.update(checksums="no"))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_sums_damaged(
            r'its "checksums" is malformed \(Expected `bool`, got `str`.*\)'
        ),
    ):
        oeqx.verify(path)


# --- under Orbax's v1 API ------------------------------------------------------
# A damaged sidecar under Orbax's v1 API: what each entry point gives.
#
# Orbax 0.12.8's `checkpointables_metadata` logs a handler's error and gives
# None for that checkpointable (its choice, not ours); `oeqx.metadata` and a
# load raise our error. Pinned so that a change on either side is seen.


DAMAGED = (
    r"orbax_eqx\.json is not JSON as orbax_eqx writes it .*the checkpoint is damaged"
)


@pytest.fixture
def cut_short(tmp_path):
    model = eqx.nn.Linear(3, 4, key=jax.random.key(0))
    ocp_v1.save_checkpointables(tmp_path / "ckpt", {"model": model})
    sidecar = tmp_path / "ckpt" / "model" / "orbax_eqx.json"
    raw = sidecar.read_bytes()
    sidecar.write_bytes(raw[: len(raw) // 2])
    return tmp_path / "ckpt", model


def test_checkpointables_metadata_logs_our_error_and_gives_none(cut_short, caplog):
    path, _ = cut_short
    with caplog.at_level(logging.WARNING):
        found = ocp_v1.checkpointables_metadata(path).metadata
    assert found == {"model": None}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Failed to get metadata for checkpointable: model" in logged
    assert (
        "is not JSON as orbax_eqx writes it" in logged
        and "Restore an earlier step" in logged
    )


def test_metadata_and_load_raise_it(cut_short):
    path, model = cut_short
    with pytest.raises(oeqx.CheckpointDamagedError, match=DAMAGED):
        oeqx.metadata(path / "model")
    with pytest.raises(oeqx.CheckpointDamagedError, match=DAMAGED):
        ocp_v1.load_checkpointables(path, {"model": model})
