"""Format 6's short records (`orbax_eqx/_format/compact.py`): rows for packed
jax arrays, paths read off names, module and node types listed once.

What a reader makes of a sidecar written short is what it makes of the same
sidecar written whole (as format 5 spells records), for every tree of the
zoo; a record is written short only where its short form says exactly the
same; and short forms written by someone else are input like any other:
each wrong one is damage naming the record, and a number in the file (a
list's length) makes nothing before it is checked.

The attacker here writes the short forms directly (`_write_raw`: the JSON
as it is, resealed), where `tests/sidecars.py` writes what a save would.
"""

import json
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo

import orbax_eqx as oeqx
from orbax_eqx._format import compact
from orbax_eqx._format.paths import CHAIN
from orbax_eqx._format.sealed import dumps
from orbax_eqx._format.sidecar import FILE_NAME

KEY = jax.random.key(0)


def _read_raw(path) -> dict:
    content = json.loads((path / FILE_NAME).read_text())
    content.pop("checksum")
    return content


def _write_raw(path, content) -> None:
    (path / FILE_NAME).write_bytes(dumps(content))  # as it is, resealed


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
        {"class": "test_compact.Stack", "static": {}, "node": 0},
        {"class": "test_compact.Residual", "static": {}, "node": 1},
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
    text = (path / FILE_NAME).read_text()
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
    restored = oeqx.restore(path, allow=["equinox", "test_compact"])
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
