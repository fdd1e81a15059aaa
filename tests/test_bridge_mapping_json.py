"""A mapping as JSON: exact round trips, today's rename maps, and hostile input
(every rule an allow list; sizes, numbers and regular expressions bounded).
"""

import json
import os
import time

import numpy as np
import pytest

import orbax_eqx as oeqx

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
        == "StateDictMapping(rules=(Stack(source='blocks', target='h.{i}'),))"
    )


def test_from_file(tmp_path):
    path = tmp_path / "mapping.json"
    path.write_text(json.dumps(EVERY_RULE.to_json()))
    assert M.from_file(path) == EVERY_RULE
    with pytest.raises(
        oeqx.BridgeError, match=r"The mapping .*nope\.json does not exist"
    ):
        M.from_file(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"format": "orbax_eqx.state_dict_mapping", "version": 1, '
        '"rules": [{"op": "zap"}]}'
    )
    with pytest.raises(
        oeqx.BridgeError,
        match=r"In .*bad\.json: .*Invalid value 'zap' - at `\$\.rules\[0\]\.op`",
    ):
        M.from_file(bad)


def test_from_file_never_blocks_on_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(oeqx.BridgeError, match=r"The mapping .*fifo"):
        M.from_file(fifo)
    assert time.monotonic() - start < 10


def test_todays_rename_maps_still_load():
    names = M.from_json({"layers.0.weight": "net.0.weight", "bias{x}": None})
    tree = {"layers": [{"weight": np.zeros(2)}], "bias{x}": np.zeros(1)}
    assert list(oeqx.to_state_dict(tree, names)) == ["net.0.weight"]
    rules = M.from_json([[r"layers\.(\d+)\.(.*)", r"net.\1.\2"], ["bias.*", None]])
    assert list(oeqx.to_state_dict(tree, rules)) == ["net.0.weight"]


def test_restore_shorthand_reads_the_other_way(tmp_path):
    """`renames={old: new}` of a restore: each new name read from its old one,
    the old names mapped to None ignored."""
    saved = {
        "net": [{"weight": np.arange(2.0) + 1}],
        "buf": np.zeros(3),
        "same": np.ones(1),
    }
    oeqx.save(tmp_path / "ckpt", saved)
    tree = {"layers": [{"weight": np.arange(2.0)}], "same": np.zeros(1)}
    out = oeqx.restore(
        tmp_path / "ckpt",
        tree,
        renames={"net.0.weight": "layers.0.weight", "buf": None, "same": "same"},
    )
    np.testing.assert_array_equal(out["layers"][0]["weight"], [1.0, 2.0])
    np.testing.assert_array_equal(out["same"], [1.0])


HOSTILE = [
    ("not json", "{", r"The mapping is not valid JSON"),
    ("not utf-8", b'["\xff"]', r"The mapping is not valid JSON"),
    ("deep", "[" * 100_000 + "]" * 100_000, r"The mapping is not valid JSON"),
    ("a number", 3, r"A mapping is a JSON object .* this is int\."),
    (
        "unknown top key",
        {"format": "orbax_eqx.state_dict_mapping", "version": 1, "rules": [], "x": 1},
        r'\(Object contains unknown field `x`\): a mapping is \{"format": "orbax',
    ),
    (
        "other version",
        {"format": "orbax_eqx.state_dict_mapping", "version": 2, "rules": []},
        r'\(Invalid enum value 2 \- at `\$\.version`\): a mapping is \{"format":',
    ),
    (
        "rule not an object",
        [3],
        r"Expected `object`, got `int` \- at `\$\[0\]`\.",
    ),
    (
        "op not a string",
        [{"op": 3}],
        r"Expected `str`, got `int` \- at `\$\[0\]\.op`\.",
    ),
    (
        "unknown op",
        [{"op": "exec"}],
        r"Invalid value 'exec' \- at `\$\[0\]\.op`\.",
    ),
    (
        "unknown key",
        [{"op": "stack", "from": "a", "to": "b.{i}", "eval": "x"}],
        r"Object contains unknown field `eval` \- at `\$\[0\]`\.",
    ),
    (
        "missing key",
        [{"op": "stack", "from": "a"}],
        r"Object missing required field `to` \- at `\$\[0\]`\.",
    ),
    (
        "axis a string",
        [{"op": "split", "match": "a", "axis": "0", "into": ["b", "c"]}],
        r"Expected `int`, got `str` \- at `\$\[0\]\.axis`\.",
    ),
    (
        "axis a boolean",
        [{"op": "split", "match": "a", "axis": True, "into": ["b", "c"]}],
        r"Expected `int`, got `bool` \- at `\$\[0\]\.axis`\.",
    ),
    (
        "axis a float",
        [{"op": "fuse", "parts": ["a", "b"], "axis": 0.5, "into": "c"}],
        r"Expected `int`, got `float` \- at `\$\[0\]\.axis`\.",
    ),
    (
        "huge axis",
        [
            {
                "op": "split",
                "match": "a",
                "axis": 1000000000000000000000000000000,
                "into": ["b", "c"],
            }
        ],
        r"Expected `int` <= 63 \- at `\$\[0\]\.axis`\.",
    ),
    (
        "huge size",
        [
            {
                "op": "split",
                "match": "a",
                "axis": 0,
                "into": ["b", "c"],
                "sizes": [1180591620717411303424, 1],
            }
        ],
        r"Expected `int` <= 4611686018427387904 \- at `\$\[0\]\.sizes\[0\]`\.",
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
        r"Expected `int` >= 0 \- at `\$\[0\]\.sizes\[0\]`\.",
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
        r"Expected `array` of length <= 64 \- at `\$\[0\]\.perm`\.",
    ),
    (
        "string too long",
        [{"op": "drop", "match": "a" * 5000}],
        r"Expected `str` of length <= 1024 \- at `\$\[0\]\.match`\.",
    ),
    (
        "too many rules",
        [{"op": "drop", "match": "a"}] * 10_001,
        r"Expected `array` of length <= 10000\.",
    ),
    (
        "names not an object",
        [{"op": "rename", "names": [["a", "b"]]}],
        r"Expected `object`, got `array` \- at `\$\[0\]\.names`\.",
    ),
    (
        "new name a number",
        [{"op": "rename", "names": {"a": 3}}],
        r"Expected `str \| null`, got `int` \- at `\$\[0\]\.names\[\.\.\.\]`\.",
    ),
    (
        "export not a boolean",
        [{"op": "tie", "tensor": "a", "to": "b", "export": "yes"}],
        r"Expected `bool`, got `str` \- at `\$\[0\]\.export`\.",
    ),
    (
        "unknown dtype",
        [{"op": "cast", "match": "a", "dtype": "object"}],
        r"Invalid enum value 'object' \- at `\$\[0\]\.dtype`\.",
    ),
    (
        "empty match list",
        [{"op": "ignore", "match": []}],
        r"Expected `array` of length >= 1 \- at `\$\[0\]\.match`\.",
    ),
    # Regular expressions that could backtrack without end.
    (
        "backreference",
        [{"op": "rename_regex", "rules": [["(\\w)\\1", "x"]]}],
        r"is not one RE2 takes",
    ),
    (
        "lookahead",
        [{"op": "rename_regex", "rules": [["(?=a)a", "x"]]}],
        r"is not one RE2 takes",
    ),
    (
        "invalid regex",
        [{"op": "rename_regex", "rules": [["(", "x"]]}],
        r"is not one RE2 takes",
    ),
    (
        "pattern not a string",
        [{"op": "rename_regex", "rules": [[3, "x"]]}],
        r"Expected `str`, got `int` \- at `\$\[0\]\.rules\[0\]\[0\]`\.",
    ),
    (
        "rule not a pair",
        [{"op": "rename_regex", "rules": [["a", "b", "c"]]}],
        r"Expected `array` of length 2, got 3 \- at `\$\[0\]\.rules\[0\]`\.",
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
    with pytest.raises(oeqx.BridgeError, match=match):
        M.from_json(data)


def test_json_size_is_bounded():
    with pytest.raises(
        oeqx.BridgeError, match=r"more than the 16 MiB a mapping may have"
    ):
        M.from_json(" " * ((16 << 20) + 1))


def test_builder_checks_as_json_does():
    with pytest.raises(
        oeqx.BridgeError,
        match=r"\.transpose\(\): Expected `int`, got `str` - at `\$\.perm\[0\]`",
    ):
        M().transpose("a", ["0"])
    with pytest.raises(oeqx.BridgeError, match=r"`cast` takes a dtype, not 'no'"):
        M().cast("a", object.__new__(type("X", (), {"__repr__": lambda s: "'no'"})))
    with pytest.raises(
        oeqx.BridgeError, match=r"Expected `array` of length >= 2 - at `\$\.into`"
    ):
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


# Patterns that make a backtracking engine run for minutes on names of a few
# dozen characters (`(a+)+b` took 28 s on 30 characters with `re`), and
# unnested repetitions (O(n^4) with `re`: 6 s on 400 characters).
HOSTILE_PATTERNS = [
    "(a+)+b",
    "(a|aa)*b",
    "(a|ab)*c",
    "(.*)(.*)(.*)(.*)b",
    ".*a.*a.*a.*a.*a.*b",
    "(x+x+)+y",
    "(?:a*)*b",
]


@pytest.mark.parametrize("pattern", HOSTILE_PATTERNS)
def test_hostile_patterns_match_in_linear_time(pattern):
    """RE2 matches any pattern in time linear in the name: each of these on
    names of 2048 characters (the longest a name may be) in well under 1 s,
    through a mapping, a `--rename` map and `renames=` alike."""
    names = ["a" * 2048, "a" * 2047 + "d", "x" * 2048]
    tree = {n: np.zeros(1) for n in names}
    start = time.monotonic()
    with pytest.raises(oeqx.BridgeError, match="matches no name"):
        oeqx.to_state_dict(tree, M().rename_regex(pattern, "new"))
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"(\w)\1", r"invalid escape sequence: \\1"),
        ("(?=a)a", r"invalid perl operator: \(\?="),
        ("(?<!a)b", r"invalid perl operator: \(\?<!"),
        ("(", r"missing \)"),
    ],
    ids=["backreference", "lookahead", "lookbehind", "invalid"],
)
def test_what_re2_refuses_is_named(pattern, why):
    with pytest.raises(
        oeqx.BridgeError,
        match=r"the pattern .* is not one RE2 takes \(" + why + r".*\)\. Patterns "
        r"are matched in linear time",
    ):
        M().rename_regex(pattern, "x")


@pytest.mark.parametrize(
    "replacement, match",
    [
        (r"h.\3", r"refers to the group 3, which the pattern"),
        (r"h.\g<nope>", r"refers to the group 'nope'"),
        (r"h\n", r"has the escape `\\n`; a replacement takes"),
    ],
    ids=["group-number", "group-name", "escape"],
)
def test_replacements_are_checked_against_the_pattern(replacement, match):
    with pytest.raises(oeqx.BridgeError, match=match):
        M().rename_regex(r"layers\.(\d+)\.(?P<rest>.*)", replacement)


def test_replacements_expand_as_re_does():
    tree = {"layers": [{"w": np.zeros(1)}], "bc": np.zeros(1)}
    mapping = M().rename_regex(
        [
            (r"layers\.(\d+)\.(?P<rest>.*)", r"h.\1.\g<rest>.\g<0>"),
            (r"b(.)(x)?", r"\\\2z"),
        ]
    )
    assert sorted(oeqx.to_state_dict(tree, mapping)) == ["\\z", "h.0.w.layers.0.w"]


def test_names_too_long_to_match():
    tensors = {"a": np.zeros(1), "b" * 3000: np.zeros(1)}
    with pytest.raises(
        oeqx.BridgeError,
        match=r"Tensor `b{60}\.\.\.` has a name of 3000 characters, more than the "
        r"2048 a name may have\.",
    ):
        oeqx.from_state_dict({"a": np.zeros(1)}, tensors)
