"""Sidecars that lie: a zero-size leaf claiming a shape, checksums stripped, JSON
that Python reads but orbax_eqx never writes (NaN, endless integers, endless
nesting). Each is damage, said in one clear error, before any array is read.
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
from console import main

import orbax_eqx as oeqx

SIDECAR = "orbax_eqx.json"


# Each edit is resealed (a checksum computed anew, as an attacker would):
# these tests probe the reader's rules, not the sidecar's checksum.
_edit = sidecars.edit
_replace = sidecars.replace


def _damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


def _one_line_error(argv, capsys, message) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(f"orbax_eqx: error: {message}\n", captured.err), captured.err


# --- a zero-size leaf claiming a shape --------------------------------------------


@pytest.fixture
def with_empty(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"e": jnp.zeros((0, 3)), "w": jnp.ones(2)})
    assert oeqx.metadata(path).leaves["e"].data == "none"
    return path


@pytest.mark.parametrize(
    "shape, elements",
    [((5, 3), 15), ((2**40, 2**40), 2**80)],
    ids=["small", "huge"],
)
def test_zero_size_leaf_claiming_a_shape_is_damage(with_empty, capsys, shape, elements):
    def claim(content):
        content["leaves"]["e"]["shape"] = list(shape)

    _edit(with_empty, claim)
    message = _damaged(
        rf"""leaf `\['e'\]` \(leaf name 'e'\) is stored as zero-size \("data": """
        rf""""none"\) but has shape \({shape[0]}, {shape[1]}\), which holds """
        rf"{elements} elements"
    )
    # Refused before anything is made: a huge one is never allocated.
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.restore(with_empty)
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.verify(with_empty)
    _one_line_error(["verify", str(with_empty)], capsys, message)
    # A shape of zero elements, however large its other sides, is no lie.
    _edit(with_empty, lambda c: c["leaves"]["e"].update(shape=[3, 0, 2**40]))
    assert oeqx.restore(with_empty)["e"].shape == (3, 0, 2**40)


def test_dimension_no_array_can_have_is_damage(with_empty):
    _edit(with_empty, lambda c: c["leaves"]["e"].update(shape=[0, 2**63]))
    with pytest.raises(
        oeqx.SidecarError,
        match=_damaged(rf"leaf 'e' has shape \[0, {2**63}\], not a list of sizes"),
    ):
        oeqx.restore(with_empty)


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


def test_saved_without_checksums_says_so_and_is_no_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)
    assert json.loads((path / SIDECAR).read_text())["checksums"] is False
    assert oeqx.metadata(path).checksums is False
    report = oeqx.verify(path)
    assert report.ok and report.unchecked == ("a",)


def test_checksums_flag_that_is_no_bool_is_damage(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)}, checksums=False)
    _edit(path, lambda c: c.update(checksums="no"))
    with pytest.raises(
        oeqx.SidecarError, match=_damaged('"checksums" must be true or false')
    ):
        oeqx.verify(path)


# --- JSON that orbax_eqx never writes ---------------------------------------------


def _sidecar_damaged(what: str) -> str:
    return (
        rf"The sidecar \S+/orbax_eqx\.json {what}; the checkpoint is damaged \(or "
        r"something else was put in its place\)\. Restore an earlier step, or "
        r"re-save it\."
    )


@pytest.fixture
def with_scalar(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"n": 12345, "w": jnp.ones(2)})
    return path


_NEVER_WRITTEN = [
    (
        "1" * 100_000,
        _sidecar_damaged(
            "holds an integer of more than 4300 digits, which orbax_eqx never "
            r"writes \(it writes long integers in hexadecimal\)"
        ),
    ),
    (
        "[" * 100_000 + "]" * 100_000,
        _sidecar_damaged("nests values deeper than orbax_eqx writes them"),
    ),
    # Not too deep for Python's JSON reader, too deep to print or compare safely.
    (
        "[" * 200 + "]" * 200,
        _damaged("leaf 'n' nests values deeper than orbax_eqx writes them"),
    ),
    ("NaN", _sidecar_damaged("holds NaN, which JSON does not have")),
    ("-Infinity", _sidecar_damaged("holds -Infinity, which JSON does not have")),
]


@pytest.mark.parametrize(
    "value, message",
    _NEVER_WRITTEN,
    ids=["long_int", "endless_nesting", "deep_nesting", "nan", "infinity"],
)
def test_json_orbax_eqx_never_writes(with_scalar, capsys, value, message):
    _replace(with_scalar, '"value": 12345', f'"value": {value}')
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.restore(with_scalar)
    out = str(with_scalar) + ".st"
    for argv in (
        ["inspect", str(with_scalar)],
        ["verify", str(with_scalar)],
        ["export", str(with_scalar), "--to", "safetensors", out],
    ):
        _one_line_error(argv, capsys, message)


class Scaled(eqx.Module):
    weight: jax.Array
    scale: float = eqx.field(static=True)


def test_infinite_static_field_is_refused_by_export_in_one_line(tmp_path, capsys):
    path = tmp_path / "ckpt"
    oeqx.save(path, Scaled(jnp.ones(2), 0.5))
    _replace(path, '"scale": {"float": "0.5"}', '"scale": Infinity')
    _one_line_error(
        ["export", str(path), "--to", "safetensors", str(tmp_path / "hf")],
        capsys,
        _sidecar_damaged("holds Infinity, which JSON does not have"),
    )
    assert not (tmp_path / "hf").exists()


# --- long integers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "n", [10**5000, -(7**20000), 2**2048], ids=["huge", "negative", "just_past"]
)
def test_long_integers_round_trip_whatever_the_digit_limit(tmp_path, capsys, n):
    path = tmp_path / "ckpt"
    # 2048 bits: 617 digits, under the lowest limit Python allows (640), so
    # still decimal, as orbax_eqx always wrote integers.
    short = (2**2048 - 1) * (1 if n > 0 else -1)
    oeqx.save(path, {"n": n, "short": short, "w": np.ones(2, np.float32)})
    leaves = json.loads((path / SIDECAR).read_text())["leaves"]
    assert leaves["n"]["value"] == {"int": hex(n)}
    assert leaves["short"]["value"] == short
    restored = oeqx.restore(path)
    assert restored["n"] == n and restored["short"] == short
    assert main(["inspect", str(path)]) == 0
    assert f"<int of {n.bit_length()} bits>" in capsys.readouterr().out


# --- records no orbax_eqx writes: one SidecarError, never a raw TypeError ------


@pytest.fixture
def varied(tmp_path):
    path = tmp_path / "ckpt"
    item = {"e": jnp.zeros((0, 3)), "w": jnp.ones(2), "z": 2j, "n": np.arange(3)}
    oeqx.save(path, item)
    return path


def _set(leaf, **fields):
    return lambda c: c["leaves"][leaf].update(**fields)


@pytest.mark.parametrize(
    "edit, what",
    [
        (_set("e", dtype="bogus"), r"leaf 'e' has unknown dtype 'bogus'"),
        (_set("e", dtype="int99"), r"leaf 'e' has unknown dtype 'int99'"),
        (_set("w", dtype="key<bogus>"), r"leaf 'w' has unknown dtype 'key<bogus>'"),
        (
            _set("n", dtype="[('a', '<i4')]"),
            r"leaf 'n' has unknown dtype \"\[\('a', '<i4'\)\]\"",
        ),
        (_set("z", value={"complex": 5}), r"leaf 'z' has no valid Python value"),
        (_set("z", value={"complex": [1]}), r"leaf 'z' has no valid Python value"),
        (_set("z", value={"complex": "x"}), r"leaf 'z' has no valid Python value"),
        (
            lambda c: c.update(format_version=0),
            r'"format_version" is 0, which no orbax_eqx ever wrote \(they write 1 '
            r"to 6\)",
        ),
        (
            lambda c: c.update(format_version=-3),
            r'"format_version" is -3, which no orbax_eqx ever wrote \(they write '
            r"1 to 6\)",
        ),
    ],
    ids=[
        "zero-size-dtype",
        "zero-size-int99",
        "key-dtype",
        "structured-dtype",
        "complex-int",
        "complex-short",
        "complex-str",
        "version-0",
        "version-negative",
    ],
)
def test_records_no_orbax_eqx_writes_are_damage_everywhere(varied, capsys, edit, what):
    _edit(varied, edit)
    message = _damaged(what)
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.restore(varied)
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.restore(varied, {"e": jnp.zeros((0, 3)), "w": jnp.ones(2), "z": 1j})
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.verify(varied)
    with pytest.raises(oeqx.SidecarError, match=message):
        oeqx.metadata(varied)
    for command in ("inspect", "verify"):
        _one_line_error([command, str(varied)], capsys, message)


# --- a sidecar of a million tiny leaves: memory bounded per byte read ---------


@pytest.mark.slow
def test_reading_a_sidecar_costs_bounded_memory_per_byte(tmp_path):
    import tracemalloc

    path = tmp_path / "ckpt"
    oeqx.save(path, {"w": jnp.ones(2)})
    content = json.loads((path / SIDECAR).read_text())
    for i in range(50_000):  # the smallest records: the most objects per byte
        content["leaves"][f"l{i}"] = {"kind": "scalar", "value": 1}
    content.pop("checksum")
    text = json.dumps(content, separators=(",", ":"))
    (path / SIDECAR).write_bytes(sidecars.seal_text(text))
    tracemalloc.start()
    try:
        found = oeqx.metadata(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(found.leaves) == 50_001
    # Measured 12x (the JSON's own objects at their peak); 17x before records
    # were dropped as read and leaves had slots.
    assert peak < 14 * len(text)


# --- format 6's data checksums -----------------------------------------------------


def test_format_6_records_xxh3_of_packed_data_and_of_itself(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0), "b": np.ones(3, np.int8)})
    text = (path / SIDECAR).read_text()
    content = json.loads(text)
    assert content["format_version"] == 6
    for record in content["leaves"].values():
        assert re.fullmatch(r"[0-9a-f]{16}", record["xxh3"]) and "crc32" not in record
    assert re.fullmatch(r"xxh3:[0-9a-f]{16}", content["checksum"])
    assert oeqx.metadata(path).leaves["a"].sum_algorithm == "xxh3"
    assert oeqx.verify(path).ok


_NOT_HEX = r", not XXH3-64 in 16 lower-case hexadecimal digits"


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda r: r.update(xxh3="0x1234"), r"has data checksum '0x1234'" + _NOT_HEX),
        (
            lambda r: r.update(xxh3="ABCDEF0123456789"),
            r"has data checksum 'ABCDEF0123456789'" + _NOT_HEX,
        ),
        (lambda r: r.update(xxh3=12345), r"has data checksum 12345" + _NOT_HEX),
        (
            lambda r: r.update(xxh3="0" * 99),
            r"has data checksum '0{36}\.\.\." + _NOT_HEX,
        ),
        (
            lambda r: r.update(crc32=12345),
            r'records a CRC-32 \("crc32"\), which a format-6 sidecar never does: '
            r"it was edited",
        ),
    ],
    ids=["prefixed", "upper-case", "integer", "too-long", "crc32"],
)
def test_a_format_6_data_checksum_not_in_16_hex_digits_is_damage(
    tmp_path, change, what
):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(10.0)})
    _edit(path, lambda c: change(c["leaves"]["a"]))
    match = _damaged(f"leaf 'a' {what}")
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.restore(path, {"a": jnp.zeros(10)})
    with pytest.raises(oeqx.SidecarError, match=match):
        oeqx.verify(path)
