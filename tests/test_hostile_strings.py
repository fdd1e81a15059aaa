"""Hostile strings and values: text that is not valid Unicode (lone
surrogates, as `os.fsdecode` makes of a file name that is not UTF-8) and
values nested too deep are refused at save, naming the leaf or field, instead
of writing a sidecar that never reads back (the fix the error gives, bytes,
saves them exactly); integers longer than Python's digit limit round-trip;
names and values holding terminal controls (ESC, CR, BEL, DEL, C1, newlines)
are printed escaped, one line each, by `inspect`, `diff` and `verify`.
"""

import json
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from entry import main

import orbax_eqx as oeqx

SIDECAR = "orbax_eqx.json"

NOT_UTF8 = os.fsdecode(b"caf\xe9")  # 'caf\udce9'
SURROGATE = (
    "holds a lone surrogate, as `os.fsdecode` makes of a file name that is not UTF-8"
)
TEXT_FIX = (
    "The sidecar (UTF-8 JSON) cannot hold text that is not valid Unicode: store it "
    "as bytes (`os.fsencode(text)`: bytes leaves, static fields and dict keys are "
    "saved exactly), or decode it first "
    "(`os.fsencode(text).decode('utf-8', 'replace')`)."
)


class Tagged(eqx.Module):
    weight: jax.Array
    tag: tuple = eqx.field(static=True)


RAW = os.fsencode(NOT_UTF8)  # b"caf\xe9": what the error says to store


@pytest.mark.parametrize(
    "item, fixed, problem",
    [
        (
            {"files": {NOT_UTF8: jnp.ones(2)}},
            {"files": {RAW: jnp.ones(2)}},
            rf"Leaf `files\.caf\\udce9` is under a dict key that is not "
            rf"valid Unicode: 'caf\\udce9' {SURROGATE}\.",
        ),
        (
            {"name": NOT_UTF8, "w": jnp.ones(2)},
            {"name": RAW, "w": jnp.ones(2)},
            rf"Leaf `name` is a str that is not valid Unicode: 'caf\\udce9' "
            rf"{SURROGATE}\.",
        ),
        (
            Tagged(jnp.ones(2), ("ok", NOT_UTF8)),
            Tagged(jnp.ones(2), ("ok", RAW)),
            r"Static field `tag` of module `<root>` \(test_hostile_strings\.Tagged\) "
            rf"holds text that is not valid Unicode: 'caf\\udce9' {SURROGATE}\.",
        ),
    ],
    ids=["dict_key", "str_value", "static_field"],
)
def test_text_that_is_not_unicode_is_refused_at_save(tmp_path, item, fixed, problem):
    path = tmp_path / "ckpt"
    message = (
        "Cannot save this item: its sidecar would not read back.\n"
        f"  - {problem}\n{re.escape(TEXT_FIX)}"
    )
    with pytest.raises(oeqx.UnsupportedLeafError, match=f"^{message}\n{_UNCHANGED}$"):
        oeqx.save(path, item)
    assert not path.exists()  # refused before writing: no checkpoint there
    # The fix the error gives works: bytes are saved, and restored, exactly.
    oeqx.save(path, fixed)
    restored = oeqx.restore(path, eqx.filter_eval_shape(lambda: fixed))
    assert jax.tree.structure(restored) == jax.tree.structure(fixed)
    assert eqx.tree_equal(restored, fixed)


def test_descriptions_escape_such_text(tmp_path):
    class Named:  # an object leaf: recorded by its repr, which may hold anything
        def __repr__(self):
            return f"Named({NOT_UTF8})"

    oeqx.save(tmp_path / "ckpt", {"n": Named(), "w": jnp.ones(1)})
    value = oeqx.metadata(tmp_path / "ckpt").leaves["n"].value
    assert value["repr"] == "Named(caf\\udce9)"


# --- values nested too deep ---------------------------------------------------------


def _nested(depth):
    value = "leaf"
    for _ in range(depth):
        value = (value,)
    return value


# The note a standalone save that failed adds: the checkpoint there is as it was.
_UNCHANGED = (
    r"orbax_eqx: this save did not change .*; its temporary files were removed\."
)


def test_static_field_nested_too_deep_is_refused_at_save(tmp_path):
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=r"^Cannot save this item: its sidecar would not read back\.\n  - Static "
        r"field `tag` of module `<root>` \(test_hostile_strings\.Tagged\) nests "
        r"more than 128 levels deep\.\nA recorded value may nest 128 JSON levels "
        r"deep \(each tuple, list or dict takes two\): make it shallower, or keep "
        r"it out of the saved item\.\n" + _UNCHANGED + "$",
    ):
        oeqx.save(tmp_path / "ckpt", Tagged(jnp.ones(2), _nested(65)))
    assert not (tmp_path / "ckpt").exists()
    # One tuple less is as deep as readers read: it saves and restores.
    model = Tagged(jnp.ones(2), _nested(64))
    oeqx.save(tmp_path / "ckpt", model)
    restored = oeqx.restore(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: model))
    assert restored.tag == model.tag


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


# --- terminal escapes ---------------------------------------------------------------


HOSTILE = "w\x1b[31mred\x07\rX\nY\x7f\x9b2J"
ESCAPED = r"w\x1b[31mred\x07\rX\nY\x7f\x9b2J"
_RAW = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.fixture
def hostile(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {HOSTILE: np.arange(4.0), "note": "v\x1b[2J", "ok": 1})
    return path


def _output(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    for text in (out.out, out.err):
        assert not _RAW.search(text), repr(text)
    return rc, out.out + out.err


@pytest.mark.parametrize(
    "argv", [["inspect"], ["inspect", "--flat"], ["verify"]], ids=str
)
def test_names_are_escaped(hostile, capsys, argv):
    rc, out = _output(capsys, [*argv, str(hostile)])
    assert rc == 0
    if argv[0] == "inspect":
        # The whole name on one line, escaped.
        (line,) = [line for line in out.splitlines() if "31m" in line]
        assert ESCAPED in line


def test_a_damaged_leaf_with_a_hostile_name_is_one_line(hostile, capsys):
    (pack,) = hostile.glob("orbax_eqx~packed.*.bin")
    data = bytearray(pack.read_bytes())
    data[0] ^= 1
    pack.write_bytes(bytes(data))
    rc, out = _output(capsys, ["verify", str(hostile)])
    assert rc == 1
    (line,) = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    assert ESCAPED in line
    # The restore's error, through the CLI, too.
    rc, out = _output(capsys, ["inspect", str(hostile)])
    assert rc == 0


def test_diff_escapes_names(hostile, tmp_path, capsys):
    other = tmp_path / "other"
    oeqx.save(other, {"ok": 2, "note": "x"})
    rc, out = _output(capsys, ["diff", str(hostile), str(other)])
    assert rc == 1
    (line,) = [line for line in out.splitlines() if "31m" in line]
    assert ESCAPED in line
