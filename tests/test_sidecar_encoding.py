"""How a save encodes its sidecar and what bounds it: format 6's short
records (rows for packed jax arrays, paths read off names, module and node
types listed once), the JSON writer's fast path, and the sidecar's size and
record limits.

Reaches inside: the short forms, the writer and the limits are the format's own units.

What a reader makes of a sidecar written short is what it makes of the same
sidecar written whole (as format 5 spells records), for every tree of the
zoo; a record is written short only where its short form says exactly the
same; and short forms written by someone else are input like any other:
each wrong one is damage naming the record, and a number in the file (a
list's length) makes nothing before it is checked. The attacker here writes
the short forms directly (`_write_raw`: the JSON as it is, resealed), where
`tests/sidecars.py` writes what a save would.
"""

import json
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx
from orbax_eqx._format import compact, sealed
from orbax_eqx._format.paths import CHAIN
from orbax_eqx._format.sealed import _ENCODER, _dump, _encoded, dumps

KEY = jax.random.key(0)


def _read_raw(path) -> dict:
    content = json.loads((path / "orbax_eqx.json").read_text())
    content.pop("checksum")
    return content


def _write_raw(path, content) -> None:
    (path / "orbax_eqx.json").write_bytes(dumps(content))  # as it is, resealed


def _edit_raw(path, change) -> None:
    content = _read_raw(path)
    change(content)
    _write_raw(path, content)


def _damaged(what: str) -> str:
    return (
        rf"The sidecar in \S+ is damaged: {what}\. Restore an earlier step, or "
        r"re-save the checkpoint\."
    )


# --- short and whole read alike -----------------------------------------------


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_short_and_whole_records_read_alike(tmp_path, make):
    path = tmp_path / "ckpt"
    oeqx.save(path, make(KEY))
    short = oeqx.metadata(path)
    _write_raw(path, sidecars.read(path))  # every record whole, as format 5
    whole = oeqx.metadata(path)
    assert short.leaves == whole.leaves
    assert short.modules == whole.modules
    assert short.nodes == whole.nodes
    restored = oeqx.restore(path, zoo.skeleton(make, jax.random.key(1)))
    zoo.assert_same(restored, make(KEY))


class Residual(eqx.Module):
    lin1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    lin2: eqx.nn.Linear


class Stack(eqx.Module):
    blocks: list


def _stack(n: int) -> Stack:
    keys = jax.random.split(KEY, 2 * n)
    return Stack(
        [
            Residual(
                eqx.nn.Linear(8, 8, key=keys[2 * i]),
                eqx.nn.LayerNorm(8),
                eqx.nn.Linear(8, 8, key=keys[2 * i + 1]),
            )
            for i in range(n)
        ]
    )


def test_a_stack_of_layers_is_written_short(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, _stack(20))
    content = _read_raw(path)
    # Every leaf a row; every module and node an index.
    assert all(type(r) is list for r in content["leaves"].values())
    assert all(type(m) is int for m in content["modules"].values())
    # A module's node is in its module type: only the list has a line.
    assert content["module_types"] == [
        {"class": "test_sidecar_encoding.Stack", "static": {}, "node": 0},
        {"class": "test_sidecar_encoding.Residual", "static": {}, "node": 1},
        {
            "class": "equinox.nn._linear.Linear",
            "static": {"in_features": 8, "out_features": 8, "use_bias": True},
            "node": 2,
        },
        {
            "class": "equinox.nn._normalisation.LayerNorm",
            "static": {
                "shape": {"tuple": [8]},
                "eps": {"float": "1e-05"},
                "use_weight": True,
                "use_bias": True,
            },
            "node": 2,
        },
    ]
    assert content["node_types"] == [
        {"type": "module", "fields": ["blocks"]},
        {"type": "module", "fields": ["lin1", "norm", "lin2"]},
        {"type": "module", "fields": ["weight", "bias"]},
        {"type": "list", "length": 20},
    ]
    assert content["nodes"] == {"blocks": 3}
    # One line per record, a row as compact JSON.
    text = (path / "orbax_eqx.json").read_text()
    w = content["leaves"]["blocks.3.lin1.weight"]
    assert f'  "blocks.3.lin1.weight": ["float32",[8,8],{w[2]},"{w[3]}"],\n' in text
    assert '  "blocks.3.lin1": 2,\n' in text
    # About the size of the data it describes (4.5 times it, whole).
    data = sum(x.nbytes for x in jax.tree_util.tree_leaves(_stack(20)))
    assert len(text) < 1.3 * data
    meta = oeqx.metadata(path)
    assert meta.leaves["blocks.3.lin1.weight"].path == ".blocks[3].lin1.weight"
    assert meta.modules["blocks.3.norm"].path == ".blocks[3].norm"
    assert meta.nodes["blocks"]["children"][19] == "blocks.19"
    assert meta.nodes["blocks.3.norm"] == {
        "path": ".blocks[3].norm",
        "type": "module",
        "fields": ["weight", "bias"],
        "children": ["blocks.3.norm.weight", "blocks.3.norm.bias"],
    }
    assert meta.nodes[""]["path"] == "<root>"


class Pair(NamedTuple):
    left: jax.Array
    right: jax.Array


def test_paths_read_off_names_under_dicts_and_lists_too(tmp_path):
    path = tmp_path / "ckpt"
    item = {
        "model": eqx.nn.Linear(2, 2, key=KEY),
        "opt": [{"mu": jnp.ones(2)}],
        "0": jnp.ones(2),  # escaped in its name: `\\0`
        "x.y": 3,  # escaped: `x\\.y`
        "pair": Pair(jnp.ones(1), jnp.ones(1)),  # fields of no module
    }
    oeqx.save(path, item)
    content = _read_raw(path)
    leaves = content["leaves"]
    assert type(leaves["model.weight"]) is list
    assert type(leaves["opt.0.mu"]) is list
    assert type(content["modules"]["model"]) is int
    assert leaves["\\0"]["path"] == "['0']"
    assert leaves["x\\.y"]["path"] == "['x.y']"
    assert leaves["pair.left"]["path"] == "['pair'].left"
    meta = oeqx.metadata(path)
    assert meta.leaves["model.weight"].path == "['model'].weight"
    assert meta.leaves["opt.0.mu"].path == "['opt'][0]['mu']"
    assert meta.modules["model"].path == "['model']"
    assert meta.nodes["opt.0"]["path"] == "['opt'][0]"
    assert meta.leaves["pair.left"].path == "['pair'].left"


# --- written short only where it says the same ---------------------------------

WHOLE = {
    "path": ".w",
    "kind": "array",
    "shape": [8, 8],
    "dtype": "float32",
    "container": "jax",
    "nbytes": 256,
    "data": "packed",
    "pack": 0,
    "offset": 64,
    "xxh3": "0123456789abcdef",
}


UNDER_A_MODULE = compact.Paths({"": {}})  # `w`: an attribute of the root


def test_a_packed_jax_array_is_a_row():
    paths = UNDER_A_MODULE
    assert compact.compact_leaf("w", dict(WHOLE), paths) == [
        "float32",
        [8, 8],
        64,
        "0123456789abcdef",
    ]
    short = compact.compact_leaf("w", dict(WHOLE), paths)
    assert sidecars.expand_leaf("w", short, paths) == WHOLE
    unsummed = {k: v for k, v in WHOLE.items() if k != "xxh3"}
    assert compact.compact_leaf("w", unsummed, paths) == ["float32", [8, 8], 64, None]
    assert sidecars.expand_leaf("w", ["float32", [8, 8], 64, None], paths) == unsummed
    # Under a dict, `w` reads as `['w']`.
    in_a_dict = dict(WHOLE, path="['w']")
    assert type(compact.compact_leaf("w", in_a_dict, compact.Paths({}))) is list


@pytest.mark.parametrize(
    "change",
    [
        {"pack": False},  # equal to 0, but no pack index
        {"pack": 1},
        {"offset": 64.0},
        {"shape": [8.0, 8]},
        {"shape": [True, 8]},
        {"nbytes": 255},
        {"dtype": "U2x"},  # no dtype at all
        {"path": "['w']"},
        {"container": "numpy"},
        {"data": "shards"},
        {"xxh3": 5},
        {"extra": 1},
    ],
    ids=lambda c: next(iter(c)) + "=" + repr(next(iter(c.values()))),
)
def test_any_other_array_record_stays_whole(change):
    record = dict(WHOLE, **change)
    short = compact.compact_leaf("w", record, UNDER_A_MODULE)
    assert isinstance(short, dict)
    assert sidecars.expand_leaf("w", short, UNDER_A_MODULE) == record


def test_modules_and_nodes_stay_whole_unless_their_types_say_the_same():
    root = {"path": "<root>", "class": "a.Root", "static": {}}
    path_off = {"path": "['m']", "class": "a.B", "static": {}}
    extra = {"path": ".n", "class": "a.B", "static": {}, "more": 1}
    modules = {"": root, "m": path_off, "n": extra}
    out = compact.compact({"leaves": {}, "modules": modules, "nodes": {}})
    assert out["modules"] == {"": 0, "m": path_off, "n": extra}
    assert out["module_types"] == [{"class": "a.Root", "static": {}}]
    # A module with an absent field: its children are not its fields' names.
    absent = {
        "path": ".m",
        "type": "module",
        "fields": ["a", "b"],
        "children": ["m.a", None],
    }
    int_keys = {"path": ".d", "type": "dict", "keys": [1], "children": ["d.1"]}
    renamed = {"path": ".l", "type": "list", "children": ["l.1"]}
    nodes = {"m": absent, "d": int_keys, "l": renamed}
    modules = {"": root}
    out = compact.compact({"leaves": {}, "modules": modules, "nodes": nodes})
    assert out["nodes"] == nodes
    assert out["node_types"] == []
    # A short module whose node is whole keeps its node's line.
    module = {"path": ".m", "class": "a.B", "static": {}}
    content = {"leaves": {}, "modules": {"": root, "m": module}, "nodes": nodes}
    out = compact.compact(content)
    assert out["modules"] == {"": 0, "m": 1}
    assert out["module_types"][1] == {"class": "a.B", "static": {}}
    assert out["nodes"]["m"] == absent
    assert sidecars.expand(out) == content


def test_what_a_name_reads_as_does_not_depend_on_what_was_read_before():
    # Names of up to `CHAIN` parts read as paths, deeper ones as none, in
    # any order: a reader reads a short record as its writer meant it.
    deep = [".".join(f"m{i}" for i in range(n)) for n in range(1, 40)]
    modules = set(deep)
    forward, backward = compact.Paths(modules), compact.Paths(modules)
    read_forward = [forward(name) for name in deep]
    read_backward = [backward(name) for name in reversed(deep)][::-1]
    assert read_forward == read_backward
    assert read_forward[CHAIN - 1] == "".join(
        f".m{i}" if i else "['m0']" for i in range(CHAIN)
    )
    assert read_forward[CHAIN:] == [None] * (39 - CHAIN)


class Wrap(eqx.Module):
    inner: Any


def test_a_model_deeper_than_a_path_is_read_off_keeps_its_paths(tmp_path):
    model: Any = eqx.nn.Linear(2, 2, key=KEY)
    for _ in range(40):
        model = Wrap(model)
    path = tmp_path / "ckpt"
    oeqx.save(path, model)
    content = _read_raw(path)
    deepest = ".".join(["inner"] * 40)
    assert content["leaves"][deepest + ".weight"]["path"]  # written whole
    meta = oeqx.metadata(path)
    walked = jax.tree_util.tree_flatten_with_path(model)[0]
    assert [r.path for r in meta.leaves.values()] == [
        jax.tree_util.keystr(p) for p, _ in walked
    ]
    restored = oeqx.restore(path, allow=["equinox", "test_sidecar_encoding"])
    for _ in range(40):
        restored, model = restored.inner, model.inner
    assert jnp.array_equal(restored.weight, model.weight)


# --- short forms written by someone else -----------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"w": jnp.ones((2, 3)), "lin": eqx.nn.Linear(2, 2, key=KEY)})
    return path


def _row(**at):
    def change(c):
        for i, value in at.items():
            c["leaves"]["w"][int(i[1:])] = value

    return change


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda c: c["leaves"]["w"].pop(), "Expected `array` of length 4"),
        (lambda c: c["leaves"]["w"].append(0), "Expected `array` of length 4"),
        (_row(i0=5), r"Expected `str`, got `int` - at `\$\[0\]`"),
        (_row(i1=[-1, 3]), r"Expected `int` >= 0 - at `\$\[1\]\[0\]`"),
        (_row(i2="0"), r"Expected `int`, got `str` - at `\$\[2\]`"),
        (_row(i3="XYZ"), r"Expected `str` matching regex .* - at `\$\[3\]`"),
    ],
    ids=["short", "long", "dtype", "shape", "offset", "checksum"],
)
def test_a_malformed_row_is_damage(saved, change, what):
    _edit_raw(saved, change)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(rf"leaf 'w' is malformed \({what}\)"),
    ):
        oeqx.metadata(saved)


@pytest.mark.parametrize(
    "change, what",
    [
        (_row(i0="U2"), r"leaf 'w' has dtype 'U2', which no save writes"),
        (_row(i2=10**6), r"leaf 'w' ends at byte 1000024 of pack 0, which holds"),
    ],
    ids=["dtype", "offset"],
)
def test_a_row_is_checked_as_its_whole_record_is(saved, change, what):
    _edit_raw(saved, change)
    with pytest.raises(oeqx.CheckpointDamagedError, match=_damaged(what + ".*")):
        oeqx.metadata(saved)


@pytest.mark.parametrize(
    "change, what",
    [
        (
            lambda c: c["modules"].update(lin=7),
            "module 'lin' is of module type 7, but the sidecar lists 1 module type",
        ),
        (
            lambda c: c["modules"].update(lin=-1),
            "module 'lin' has no class, path or static fields",
        ),
        (
            lambda c: c.update(module_types={"0": {}}),
            r'its "module_types" is malformed \(Expected `array`, got `object`.*\)',
        ),
        (
            lambda c: c["module_types"][0].pop("class"),
            r'its "module_types" is malformed \(Object missing required field '
            r"`class` - at `\$\.module_types\[0\]`\)",
        ),
        (
            lambda c: c["nodes"].update({"": 3}),
            "node '' is of node type 3, but the sidecar lists 2 node types",
        ),
        (
            lambda c: c.update(node_types=[]),
            r"module type 0 \(of module 'lin'\) gives its node type as 0, which is "
            "no module's node type among the sidecar's 0 node types",
        ),
        (
            lambda c: c["module_types"][0].update(node=1),  # the dict's
            r"module type 0 \(of module 'lin'\) gives its node type as 1, which is "
            "no module's node type among the sidecar's 2 node types",
        ),
        (
            lambda c: c["module_types"][0].update(node=-1),
            r'its "module_types" is malformed \(Expected `int` >= 0 - at '
            r"`\$\.module_types\[0\]\.node`\)",
        ),
        (
            lambda c: c["module_types"][0].update(node="0"),
            r'its "module_types" is malformed \(Expected `int`, got `str` - at '
            r"`\$\.module_types\[0\]\.node`\)",
        ),
        (
            lambda c: c["module_types"][0].update(node=None),
            r'its "module_types" is malformed \(Expected `int`, got `null` - at '
            r"`\$\.module_types\[0\]\.node`\)",
        ),
        (
            lambda c: c["nodes"].update(lin=0),
            "node 'lin' is recorded twice: in \"nodes\" and by its module's type",
        ),
        (
            lambda c: c["node_types"][1].update(type="other"),
            r'its "node_types" is malformed \(Invalid enum value .other. - at '
            r"`\$\.node_types\[1\]\.type`\)",
        ),
    ],
    ids=[
        "module-past-the-table",
        "module-negative",
        "module-types-not-a-list",
        "module-type-without-class",
        "node-past-the-table",
        "node-types-empty",
        "module-node-not-a-module",
        "module-node-negative",
        "module-node-a-string",
        "module-node-null",
        "node-recorded-twice",
        "node-type-other",
    ],
)
def test_malformed_types_are_damage(saved, change, what):
    content = _read_raw(saved)
    assert content["modules"]["lin"] == 0  # the one module type
    assert content["module_types"][0]["node"] == 0  # with its node's type
    assert content["node_types"][1]["type"] == "dict"
    assert content["nodes"] == {"": 1}  # the dict, the module's in its type
    _edit_raw(saved, change)
    with pytest.raises(oeqx.CheckpointDamagedError, match=_damaged(what)):
        oeqx.metadata(saved)
    with pytest.raises(oeqx.CheckpointDamagedError, match=_damaged(what)):
        oeqx.restore(saved, allow=["equinox"])


def test_a_length_is_checked_before_any_name_is_made(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"layers": [jnp.ones(2), jnp.ones(3)]})
    content = _read_raw(path)
    assert content["node_types"][1] == {"type": "list", "length": 2}
    content["node_types"][1]["length"] = 10**15  # names would not fit in memory
    _write_raw(path, content)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(
            r"its node types name more children than it has leaves and nodes "
            r"\(4\), at node 'layers'"
        ),
    ):
        oeqx.metadata(path)


def test_zero_size_and_numpy_arrays_are_whole(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"e": jnp.zeros((0, 3)), "n": np.ones(3), "j": jnp.ones(3)})
    leaves = _read_raw(path)["leaves"]
    assert leaves["e"]["data"] == "none" and "path" not in leaves["e"]
    assert leaves["n"]["container"] == "numpy"
    assert type(leaves["j"]) is list


@pytest.mark.parametrize("make", zoo.ZOO.values(), ids=zoo.ZOO.keys())
def test_a_save_writes_short_what_compact_would(tmp_path, make):
    # The save makes packed jax arrays' rows itself (`sidecar.build`), the
    # rest short from whole records (`compact.compact`): the same bytes as
    # making every record whole first and then short.
    path = tmp_path / "ckpt"
    oeqx.save(path, make(KEY))
    content = _read_raw(path)
    assert compact.compact(sidecars.expand(content)) == content


def test_a_deep_chain_reads_its_paths_and_a_hostile_one_costs_little(tmp_path):
    # A chain of 100 nested dicts: its one leaf's 100 ancestors are more
    # than are made at once (`paths.CHAIN`), so its path is written whole;
    # read back the same.
    deep = jnp.ones(2)
    for i in range(100):
        deep = {f"k{i}": deep}
    path = tmp_path / "ckpt"
    oeqx.save(path, deep)
    name = ".".join(f"k{i}" for i in reversed(range(100)))
    leaf = _read_raw(path)["leaves"][name]
    assert leaf["path"] == "".join(f"['k{i}']" for i in reversed(range(100)))
    assert oeqx.metadata(path).leaves[name].path == leaf["path"]
    # Names of thousands of parts, each unrelated to the others: each makes
    # at most `CHAIN` ancestors (not thousands), and reads as its name.
    paths = compact.Paths({})
    for i in range(200):
        long = ".".join(f"p{i}x{j}" for j in range(5000))
        assert paths(long) is None and paths.of(long) == long


def test_a_shape_of_more_dimensions_than_numpy_has_is_damage(saved):
    # (math.prod of a million dimensions takes hours: refused unmultiplied)
    _edit_raw(saved, _row(i1=[1] * 65))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(r"leaf 'w' is malformed \(Expected `array` of length <= 64.*\)"),
    ):
        oeqx.metadata(saved)
    # The same in a whole record.

    def whole_record(c):
        paths = compact.Paths(c["modules"])
        c["leaves"]["w"] = sidecars.expand_leaf("w", c["leaves"]["w"], paths)
        c["leaves"]["w"]["shape"] = [2**62] * 1000

    _edit_raw(saved, whole_record)
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(r"leaf 'w' is malformed \(Expected `array` of length <= 64.*\)"),
    ):
        oeqx.metadata(saved)


# --- the writer's fast path ------------------------------------------------


# Private on purpose: records are written by msgspec where it writes what the
# standard library's encoder writes, byte for byte, and by that encoder
# elsewhere; the sidecar's text (and so its checksum line) is one either way.
@pytest.mark.parametrize(
    "value",
    [
        {"path": ".a[0]", "shape": [8, 8], "nbytes": 256, "xxh3": "c0c1548425ae43f7"},
        {"static": {"shape": {"tuple": [8]}, "eps": {"float": "1e-05"}}},
        ['é"\\ \x01\x1f\x7f\u2028😀', [], {}, [[], {"x": [1, [2, True, False]]}]],
        {"sum32": None, "nullable": "null"},
        "lone \udc80 surrogate",
        10**30,
        -(2**63),
    ],
)
def test_records_are_written_as_the_json_encoder_writes_them(value):

    assert _encoded(value) == _ENCODER.encode(value)


@pytest.mark.parametrize("number", [float("nan"), float("inf"), -float("inf")])
def test_a_number_json_has_not_is_refused_as_before(number):

    with pytest.raises(ValueError, match="Out of range float values"):
        _encoded({"value": [1, number]})


@pytest.mark.parametrize(
    "name",
    [
        "blocks.0.w",
        'a"b',
        "back\\slash",
        "tab\there",
        "\x00",
        "\x7f\u2028é😀",
        "",
        "\udc80",
    ],
)
def test_names_are_written_as_the_json_encoder_writes_them(name):
    # Plain names are written between quotes without the encoder: the same bytes.

    record = {"kind": "array"}
    (written,) = _dump({"leaves": {name: record}})
    expected = f"  {_ENCODER.encode(name)}: {_ENCODER.encode(record)}"
    assert written == f' "leaves": {{\n{expected}\n }}'


# --- the size and record limits, lowered -----------------------------------
# A save whose sidecar would be larger than readers read back is refused,
# saying why and giving the fix that fits: many leaves (save fewer, larger
# arrays, or split the item) or one large record (a big Python value). Each fix
# is then shown to work under the same limit.
#
# The limit is 256 MiB; these tests lower it (`sealed.MAX_BYTES`, the one the
# save checks against) so that a few hundred leaves reach it. So for the most
# records a sidecar may hold (`sealed.MAX_RECORDS`, 2**21), which bounds what
# reading one costs where short records would let 256 MiB name ten million.


LIMIT = 60_000


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(sealed, "MAX_BYTES", LIMIT)


# The fix both "too many" messages end with.
FEWER = (
    r"Save fewer, larger arrays \(stack repeated layers into one array per "
    r"parameter, as `eqx\.filter_vmap` builds them and `jax\.lax\.scan` runs "
    r"them\), or split the item into several items of one checkpoint "
    r"\(`ocp\.args\.Composite`\), each with a sidecar of its own\.$"
)


def _layers(n: int) -> dict[str, np.ndarray]:
    return {f"layer{i:03d}": np.full((2,), i, np.float32) for i in range(n)}


def test_too_many_leaves_says_so_and_the_fixes_work(tmp_path, small_limit):
    item = _layers(400)
    with pytest.raises(oeqx.UnsupportedLeafError) as caught:
        oeqx.save(tmp_path / "ckpt", item)
    message = str(caught.value)
    assert re.match(
        r"^Cannot save this item: its sidecar would be \d+ bytes, more than the "
        rf"{LIMIT} orbax_eqx reads back\. It records 400 leaves and 0 modules; "
        r"the largest record, that of node `<root>`, is \d+ bytes\. That "
        r"is about \d+ bytes a leaf\. " + FEWER,
        message,
    ), message
    assert not (tmp_path / "ckpt").exists()

    # Fix 1: one stacked array instead of 400 small ones.
    stacked = {"layers": np.stack(list(item.values()))}
    oeqx.save(tmp_path / "stacked", stacked)
    back = oeqx.restore(tmp_path / "stacked", stacked)
    np.testing.assert_array_equal(back["layers"], stacked["layers"])

    # Fix 2: the same leaves as two items of one step, a sidecar each.
    halves = {
        "first": dict(list(item.items())[:200]),
        "second": dict(list(item.items())[200:]),
    }
    handlers = {name: oeqx.EqxHandler() for name in halves}
    with ocp.CheckpointManager(
        tmp_path / "root", item_names=tuple(halves), item_handlers=handlers
    ) as mngr:
        saved = {name: oeqx.EqxSave(part) for name, part in halves.items()}
        mngr.save(0, args=ocp.args.Composite(**saved))
        mngr.wait_until_finished()
        wanted = {name: oeqx.EqxRestore(part) for name, part in halves.items()}
        back = mngr.restore(0, args=ocp.args.Composite(**wanted))
    for name, part in halves.items():
        assert eqx.tree_equal(dict(back[name]), part)


class Tagged(eqx.Module):
    weight: np.ndarray
    note: str = eqx.field(static=True)


def test_one_large_value_says_so_and_the_fix_works(tmp_path, small_limit):
    text = "x" * LIMIT
    with pytest.raises(oeqx.UnsupportedLeafError) as caught:
        oeqx.save(tmp_path / "ckpt", Tagged(jnp.ones(2), text))
    message = str(caught.value)
    assert re.match(
        r"^Cannot save this item: its sidecar would be \d+ bytes, more than the "
        rf"{LIMIT} orbax_eqx reads back\. It records 1 leaf and 1 module; the "
        r"largest record, that of module `<root>`, is \d+ bytes\. Keep large "
        r"Python values \(str, bytes, static fields\) out of the item, or store "
        r"them as arrays \(`np\.frombuffer\(data, np\.uint8\)`\)\.$",
        message,
    ), message
    assert not (tmp_path / "ckpt").exists()
    # The fix: the text as an array of its bytes.
    fixed = {"weight": jnp.ones(2), "note": np.frombuffer(text.encode(), np.uint8)}
    oeqx.save(tmp_path / "ckpt", fixed)
    back = oeqx.restore(tmp_path / "ckpt", fixed)
    assert back["note"].tobytes().decode() == text


@pytest.fixture
def few_records(monkeypatch):
    monkeypatch.setattr(sealed, "MAX_RECORDS", 150)


def test_too_many_records_says_so_and_the_fix_works(tmp_path, few_records):
    item = _layers(200)  # 200 leaves and the root dict's node
    with pytest.raises(oeqx.UnsupportedLeafError) as caught:
        oeqx.save(tmp_path / "ckpt", item)
    message = str(caught.value)
    assert re.match(
        r"^Cannot save this item: its sidecar would hold 201 records \(of 200 "
        r"leaves, their modules and the tree's inner nodes\), more than the 150 "
        r"orbax_eqx reads back\. " + FEWER,
        message,
    ), message
    assert not (tmp_path / "ckpt").exists()
    stacked = {"layers": np.stack(list(item.values()))}  # the fix
    oeqx.save(tmp_path / "stacked", stacked)
    back = oeqx.restore(tmp_path / "stacked", stacked)
    np.testing.assert_array_equal(back["layers"], stacked["layers"])


def test_a_sidecar_of_more_records_is_not_read(tmp_path, monkeypatch):
    oeqx.save(tmp_path / "ckpt", _layers(200))  # as another writer might
    monkeypatch.setattr(sealed, "MAX_RECORDS", 150)
    damaged = (
        r"The sidecar in \S+ is damaged: it holds 201 records \(leaves, modules "
        r"and nodes\), more than any save writes \(150\)\."
    )
    with pytest.raises(oeqx.CheckpointDamagedError, match=damaged):
        oeqx.metadata(tmp_path / "ckpt")
    with pytest.raises(
        oeqx.CheckpointDamagedError, match=damaged.replace("201", "200")
    ):
        oeqx.restore(tmp_path / "ckpt", _layers(200))  # (its nodes read past)
