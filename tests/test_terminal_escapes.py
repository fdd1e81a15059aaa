"""A hostile checkpoint cannot drive the terminal: names and values holding
ESC, CR, BEL, DEL, C1 controls or newlines are printed escaped, one line
each, by `inspect`, `diff` and `verify`."""

import re

import numpy as np
import pytest

import orbax_eqx as oeqx
from orbax_eqx._tools.cli import main

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
