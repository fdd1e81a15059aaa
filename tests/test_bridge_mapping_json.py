"""A mapping as JSON: exact round trips, today's rename maps, and hostile input
(every rule an allow list; sizes, numbers and regular expressions bounded).

Internal modules imported here (`_bridge.mapping`) are the units these tests
pin, or the only way to cause or observe the condition under test; everything
else goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import json
import os
import time

import numpy as np
import pytest

import orbax_eqx as oeqx
from orbax_eqx._bridge.mapping import MAX_JSON_BYTES, for_import

M = oeqx.StateDictMapping

EVERY_RULE = (
    M()
    .rename({"embed": "wte", "drop.me": None, "x{{y}}": "{{z}}"})
    .rename_regex([(r"layers\.(\d+)\.(.*)", r"h.\1.\2"), ("junk", None)])
    .field_keys("sd_key")
    .stack("blocks", "h.{i}")
    .transpose(["h.{i}.*.weight", "h.**"], (1, 0))
    .transpose("a")
    .split("h.{i}.qkv", ["h.{i}.q", "h.{i}.k", "h.{i}.v"], axis=-1, sizes=[4, 2, 2])
    .split("x", ["x0", "x1"], axis=0)
    .fuse(["h.{i}.a", "h.{i}.b"], "h.{i}.ab", axis=1)
    .cast("**", "bfloat16")
    .drop(["freqs", "*.inv{*}"])
    .ignore("h.{i}.attn.bias")
    .tie("lm_head.weight", "wte.weight", export=True)
)


def test_every_rule_round_trips_exactly():
    data = EVERY_RULE.to_json()
    assert data["format"] == "orbax_eqx.state_dict_mapping" and data["version"] == 1
    assert [r["op"] for r in data["rules"]] == [
        "rename",
        "rename_regex",
        "field_keys",
        "stack",
        "transpose",
        "transpose",
        "split",
        "split",
        "fuse",
        "cast",
        "drop",
        "ignore",
        "tie",
    ]
    text = json.dumps(data)
    again = M.from_json(text)
    assert again == EVERY_RULE
    assert again.to_json() == data
    assert M.from_json(text.encode()) == EVERY_RULE
    assert repr(again) == repr(EVERY_RULE)
    assert (
        repr(M().stack("blocks", "h.{i}"))
        == 'StateDictMapping().stack("blocks", "h.{i}")'
    )


def test_from_file(tmp_path):
    path = tmp_path / "mapping.json"
    path.write_text(json.dumps(EVERY_RULE.to_json()))
    assert M.from_file(path) == EVERY_RULE
    with pytest.raises(
        oeqx.MappingError, match=r"The mapping .*nope\.json does not exist"
    ):
        M.from_file(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"format": "orbax_eqx.state_dict_mapping", "version": 1, '
        '"rules": [{"op": "zap"}]}'
    )
    with pytest.raises(
        oeqx.MappingError, match=r"In .*bad\.json: Rule 0 has the unknown op 'zap'"
    ):
        M.from_file(bad)


def test_from_file_never_blocks_on_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(oeqx.MappingError, match=r"The mapping .*fifo"):
        M.from_file(fifo)
    assert time.monotonic() - start < 10


def test_todays_rename_maps_still_load():
    names = M.from_json({"layers.0.weight": "net.0.weight", "bias{x}": None})
    tree = {"layers": [{"weight": np.zeros(2)}], "bias{x}": np.zeros(1)}
    assert list(oeqx.to_state_dict(tree, names)) == ["net.0.weight"]
    rules = M.from_json([[r"layers\.(\d+)\.(.*)", r"net.\1.\2"], ["bias.*", None]])
    assert list(oeqx.to_state_dict(tree, rules)) == ["net.0.weight"]


def test_import_rename_maps_read_the_other_way():
    """`import --rename` maps tensor names to leaf names; applied to a file's
    names, it becomes a mapping of leaves to tensors."""
    mapping = for_import(
        {"net.0.weight": "layers.0.weight", "buf": None, "same": "same"}
    )
    tree = {"layers": [{"weight": np.arange(2.0)}], "same": np.zeros(1)}
    tensors = {
        "net.0.weight": np.arange(2.0) + 1,
        "buf": np.zeros(3),
        "same": np.ones(1),
    }
    out = oeqx.from_state_dict(tree, tensors, mapping)
    np.testing.assert_array_equal(out["layers"][0]["weight"], [1.0, 2.0])


HOSTILE = [
    ("not json", "{", r"The mapping is not valid JSON"),
    ("not utf-8", b'["\xff"]', r"The mapping is not valid JSON"),
    ("deep", "[" * 100_000 + "]" * 100_000, r"The mapping is not valid JSON"),
    ("a number", 3, r"A mapping is a JSON object .* this is int\."),
    (
        "unknown top key",
        {"format": "orbax_eqx.state_dict_mapping", "version": 1, "rules": [], "x": 1},
        r"the unknown key 'x'",
    ),
    (
        "other version",
        {"format": "orbax_eqx.state_dict_mapping", "version": 2, "rules": []},
        r"version 2; this orbax_eqx reads .* version 1\.",
    ),
    ("rule not an object", [3], r"Rule 0 must be a JSON object with an \"op\"\."),
    ("op not a string", [{"op": 3}], r"Rule 0 must be a JSON object with an \"op\"\."),
    ("unknown op", [{"op": "exec"}], r"Rule 0 has the unknown op 'exec'; the ops are"),
    (
        "unknown key",
        [{"op": "stack", "from": "a", "to": "b.{i}", "eval": "x"}],
        r"Rule 0 \(stack\) has the unknown key 'eval': a `stack` rule takes "
        r'"from", "to"\.',
    ),
    (
        "missing key",
        [{"op": "stack", "from": "a"}],
        r'Rule 0 \(stack\) lacks the key "to"\.',
    ),
    (
        "axis a string",
        [{"op": "split", "match": "a", "axis": "0", "into": ["b", "c"]}],
        r'Rule 0 \(split\): "axis" must be an integer, not a string\.',
    ),
    (
        "axis a boolean",
        [{"op": "split", "match": "a", "axis": True, "into": ["b", "c"]}],
        r'"axis" must be an integer, not the boolean true\.',
    ),
    (
        "axis a float",
        [{"op": "fuse", "parts": ["a", "b"], "axis": 0.5, "into": "c"}],
        r'"axis" must be an integer, not the number 0\.5\.',
    ),
    (
        "huge axis",
        [{"op": "split", "match": "a", "axis": 10**30, "into": ["b", "c"]}],
        r'"axis" is 1000000000000000000000000000000: it must be from -64 to 63\.',
    ),
    (
        "huge size",
        [
            {
                "op": "split",
                "match": "a",
                "axis": 0,
                "into": ["b", "c"],
                "sizes": [2**70, 1],
            }
        ],
        r'"sizes"\[0\] is 1180591620717411303424: it must be from 0 to',
    ),
    (
        "negative size",
        [
            {
                "op": "split",
                "match": "a",
                "axis": 0,
                "into": ["b", "c"],
                "sizes": [-1, 1],
            }
        ],
        r'"sizes"\[0\] is -1',
    ),
    (
        "sizes of other length",
        [{"op": "split", "match": "a", "axis": 0, "into": ["b", "c"], "sizes": [1]}],
        r'"sizes" has 1 entries for the 2 names of "into"\.',
    ),
    (
        "not a permutation",
        [{"op": "transpose", "match": "a", "perm": [0, 0]}],
        r'"perm" \[0, 0\] is not a permutation of the axes 0 to 1\.',
    ),
    (
        "perm too long",
        [{"op": "transpose", "match": "a", "perm": list(range(65))}],
        r'"perm" has 65 entries, more than the 64 allowed\.',
    ),
    (
        "string too long",
        [{"op": "drop", "match": "a" * 5000}],
        r'"match" is 5000 characters long, more than the 1024 allowed\.',
    ),
    (
        "too many rules",
        [{"op": "drop", "match": "a"}] * 10_001,
        r"The mapping has 10001 rules, more than the 10000 allowed\.",
    ),
    (
        "names not an object",
        [{"op": "rename", "names": [["a", "b"]]}],
        r'"names" must be an object of names',
    ),
    (
        "new name a number",
        [{"op": "rename", "names": {"a": 3}}],
        r'the new name of "a" must be a string, not the number 3\.',
    ),
    (
        "export not a boolean",
        [{"op": "tie", "tensor": "a", "to": "b", "export": "yes"}],
        r'"export" must be true or false, not a string\.',
    ),
    (
        "unknown dtype",
        [{"op": "cast", "match": "a", "dtype": "object"}],
        r"casts to 'object': the dtype must be one of bool, uint8",
    ),
    (
        "empty match list",
        [{"op": "ignore", "match": []}],
        r'"match" is empty: give at least one name\.',
    ),
    # Regular expressions that could backtrack without end.
    (
        "nested repeat",
        [{"op": "rename_regex", "rules": [["(a+)+b", "x"]]}],
        r"The pattern '\(a\+\)\+b' of a `rename_regex` rule repeats something that "
        r"itself repeats",
    ),
    (
        "repeated choice",
        [{"op": "rename_regex", "rules": [["(a|ab)*c", "x"]]}],
        r"repeats a choice of alternatives",
    ),
    (
        "backreference",
        [{"op": "rename_regex", "rules": [[r"(\w)\1", "x"]]}],
        r"has a backreference, which renames do not take",
    ),
    (
        "lookahead",
        [{"op": "rename_regex", "rules": [["(?=a)a", "x"]]}],
        r"has a lookaround",
    ),
    (
        "many repeats",
        [{"op": "rename_regex", "rules": [[".*a.*a.*a.*a.*b", "x"]]}],
        r"has 5 repetitions .* more than the 4 allowed",
    ),
    (
        "invalid regex",
        [{"op": "rename_regex", "rules": [["(", "x"]]}],
        r"is not a valid regular expression",
    ),
    (
        "pattern not a string",
        [{"op": "rename_regex", "rules": [[3, "x"]]}],
        r'"rules"\[0\]\[0\] must be a string, not the number 3\.',
    ),
    (
        "rule not a pair",
        [{"op": "rename_regex", "rules": [["a", "b", "c"]]}],
        r'"rules"\[0\] has 3 entries, more than the 2 allowed\.',
    ),
    # Templates.
    (
        "unclosed hole",
        [{"op": "stack", "from": "a", "to": "h.{i"}],
        r"has a `\{` at 2 that opens no hole like `\{i\}`",
    ),
    (
        "stray brace",
        [{"op": "drop", "match": "a}"}],
        r"has a `\}` at 1 that closes no hole",
    ),
    (
        "hole twice",
        [{"op": "stack", "from": "a", "to": "h.{i}.{i}"}],
        r"has the hole `\{i\}` twice",
    ),
    (
        "wildcard in a stack",
        [{"op": "stack", "from": "a.*", "to": "h.{i}"}],
        r"has a wildcard `\*`, which this rule does not take",
    ),
    (
        "too many wildcards",
        [{"op": "drop", "match": "*.*.*.*.*"}],
        r"has 5 wildcards, more than the 2 allowed",
    ),
    (
        "holes side by side",
        [{"op": "stack", "from": "a", "to": "h.{i}{j}"}],
        r"has `\{i\}\{j\}` with no text between: separate holes and wildcards",
    ),
    (
        "wildcard beside a hole",
        [{"op": "split", "match": "h.*{i}", "axis": 0, "into": ["a.{i}", "b.{i}"]}],
        r"has `\*\{i\}` with no text between",
    ),
    (
        "digit beside a hole",
        [{"op": "stack", "from": "a", "to": "h1{i}"}],
        r"has a digit next to a hole",
    ),
    (
        "stack without a new hole",
        [{"op": "stack", "from": "a.{i}", "to": "h.{i}"}],
        r'"to" has no new hole like `\{i\}` for the layer index\.',
    ),
    (
        "stack losing a hole",
        [{"op": "stack", "from": "a.{i}", "to": "h.{j}"}],
        r'"to" lacks the hole `\{i\}` of "from"',
    ),
    (
        "split into a hole it lacks",
        [{"op": "split", "match": "a", "axis": 0, "into": ["b.{i}", "c"]}],
        r'"into"\[0\] \'b\.\{i\}\' has the hole `\{i\}`, which "match" lacks\.',
    ),
    (
        "fuse of other holes",
        [{"op": "fuse", "parts": ["a.{i}", "b"], "axis": 0, "into": "c.{i}"}],
        r'"parts"\[1\] \'b\' has other holes than "parts"\[0\]',
    ),
    (
        "rename into a hole it lacks",
        [{"op": "rename", "names": {"a": "b.{i}"}}],
        r"gives the new name 'b\.\{i\}' the hole `\{i\}`, which the entry lacks",
    ),
]


@pytest.mark.parametrize(
    "data, match", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_json_is_refused_naming_the_rule(data, match):
    with pytest.raises(oeqx.MappingError, match=match):
        M.from_json(data)


def test_json_size_is_bounded():
    with pytest.raises(
        oeqx.MappingError, match=r"more than the 16 MiB a mapping may have"
    ):
        M.from_json(" " * (MAX_JSON_BYTES + 1))


def test_builder_checks_as_json_does():
    with pytest.raises(
        oeqx.MappingError, match=r'"perm"\[0\] must be an integer, not a string'
    ):
        M().transpose("a", ["0"])
    with pytest.raises(oeqx.MappingError, match=r"`cast` takes a dtype, not 'no'"):
        M().cast("a", object.__new__(type("X", (), {"__repr__": lambda s: "'no'"})))
    with pytest.raises(oeqx.MappingError, match=r'"into" must name at least two parts'):
        M().split("a", ["b"], axis=0)


def test_matching_stays_fast_on_hostile_names_and_templates():
    """The worst template allowed, against the longest names allowed, many of
    them: milliseconds each."""
    tree = {"a" * 2000: np.zeros(1)}
    tensors = {"a" * 2040 + f"{i}": np.zeros(1) for i in range(50)}
    start = time.monotonic()
    with pytest.raises(oeqx.BridgeError):
        oeqx.to_state_dict(tree, M().drop("**a**b"))
    mapping = M().ignore(["**a**b", "*a*b"]).stack("x", "x.{i}")
    with pytest.raises(oeqx.BridgeError):
        oeqx.from_state_dict(tree, tensors, mapping)
    assert time.monotonic() - start < 10


def test_names_too_long_to_match():
    tensors = {"a": np.zeros(1), "b" * 3000: np.zeros(1)}
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Tensor `b{60}\.\.\.` has a name of 3000 characters, more than the "
        r"2048 a name may have\.",
    ):
        oeqx.from_state_dict({"a": np.zeros(1)}, tensors)
