"""Hostile sidecar records, resealed as an attacker would (`tests/sidecars.py`):
where a leaf's bytes are said to be, shapes, dtypes, values and names, and
records of the tree. Each fails with a clear error of our own, or is only a
dict key, touches nothing, and allocates nothing before sizes are checked.
"""

import asyncio
import json
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import tensorstore as ts
import zoo
from children import restore_in_child
from entry import main
from untouched import fails_touching_nothing, snapshot

import orbax_eqx as oeqx

# --- records of values and of the tree -----------------------------------------
# Hostile sidecar records: a zero-size leaf claiming a shape, JSON that
# Python reads but orbax_eqx never writes (NaN, endless integers, endless
# nesting), values of no dtype or type a save records, and records of the tree
# that disagree or nest without end. Each is damage, said in one clear error of
# our own (never a raw `TypeError`), before any array is read, by every reader:
# a restore (flat, into a skeleton, rebuilt with `allow=`), `metadata`,
# `verify`, and `orbax-eqx inspect`/`verify`/`export`.
#
# Each edit is resealed (a checksum computed anew, as an attacker would:
# `tests/sidecars.py`): these tests probe the reader's rules, not the seal.


KEY = jax.random.key(0)
SIDECAR = "orbax_eqx.json"

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
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(with_empty)
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.verify(with_empty)
    _one_line_error(["verify", str(with_empty)], capsys, message)
    # A shape of zero elements, however large its other sides, is no lie.
    _edit(with_empty, lambda c: c["leaves"]["e"].update(shape=[3, 0, 2**40]))
    assert oeqx.restore(with_empty)["e"].shape == (3, 0, 2**40)


def test_dimension_no_array_can_have_is_damage(with_empty):
    _edit(with_empty, lambda c: c["leaves"]["e"].update(shape=[0, 2**63]))
    with pytest.raises(
        oeqx.CheckpointDamagedError,
        match=_damaged(
            r"leaf 'e' is malformed \(Expected `int` <= 4611686018427387904 - at "
            r"`\$\.shape\[1\]`\)"
        ),
    ):
        oeqx.restore(with_empty)


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


_MALFORMED = r"is not JSON as orbax_eqx writes it \(JSON is malformed: [^)]+\)\)"
_NEVER_WRITTEN = [
    (
        "1" * 100_000,
        _damaged(
            r"leaf 'n' is malformed \(Integer value out of range - at `\$\.value`\)"
        ),
    ),
    (
        "[" * 100_000 + "]" * 100_000,
        _sidecar_damaged(
            r"is not JSON as orbax_eqx writes it \(maximum recursion depth exceeded"
            r" while deserializing an object\)"
        ),
    ),
    # Not too deep for Python's JSON reader, too deep to print or compare safely.
    (
        "[" * 200 + "]" * 200,
        _damaged("leaf 'n' nests values deeper than orbax_eqx writes them"),
    ),
    ("NaN", _sidecar_damaged(_MALFORMED)),
    ("-Infinity", _sidecar_damaged(_MALFORMED)),
]


@pytest.mark.parametrize(
    "value, message",
    _NEVER_WRITTEN,
    ids=["long_int", "endless_nesting", "deep_nesting", "nan", "infinity"],
)
def test_json_orbax_eqx_never_writes(with_scalar, capsys, value, message):
    _replace(with_scalar, '"value": 12345', f'"value": {value}')
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
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
        _sidecar_damaged(_MALFORMED),
    )
    assert not (tmp_path / "hf").exists()


# --- records no orbax_eqx writes: one SidecarError, never a raw TypeError ------


@pytest.fixture
def varied(tmp_path):
    path = tmp_path / "ckpt"
    item = {"e": jnp.zeros((0, 3)), "w": jnp.ones(2), "z": 2j, "n": np.arange(3)}
    oeqx.save(path, item)
    return path


def _values_set(leaf, **fields):
    return lambda c: c["leaves"][leaf].update(**fields)


@pytest.mark.parametrize(
    "edit, what",
    [
        (_values_set("e", dtype="bogus"), r"leaf 'e' has unknown dtype 'bogus'"),
        (_values_set("e", dtype="int99"), r"leaf 'e' has unknown dtype 'int99'"),
        (
            _values_set("w", dtype="key<bogus>"),
            r"leaf 'w' has unknown dtype 'key<bogus>'",
        ),
        (
            _values_set("n", dtype="[('a', '<i4')]"),
            r"leaf 'n' has unknown dtype \"\[\('a', '<i4'\)\]\"",
        ),
        (_values_set("z", value={"complex": 5}), r"leaf 'z' has no valid Python value"),
        (
            _values_set("z", value={"complex": [1]}),
            r"leaf 'z' has no valid Python value",
        ),
        (
            _values_set("z", value={"complex": "x"}),
            r"leaf 'z' has no valid Python value",
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
    ],
)
def test_records_no_orbax_eqx_writes_are_damage_everywhere(varied, capsys, edit, what):
    _edit(varied, edit)
    message = _damaged(what)
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(varied)
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.restore(varied, {"e": jnp.zeros((0, 3)), "w": jnp.ones(2), "z": 1j})
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
        oeqx.verify(varied)
    with pytest.raises(oeqx.CheckpointDamagedError, match=message):
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


# --- records of the tree, met by a rebuild (`allow=`) and by `inspect` ---------
# Each says what is wrong, and never speaks of a skeleton where there is none.


@pytest.fixture
def tree(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": np.ones(2), "b": 3, "d": {"k": jnp.ones(2)}})
    return path


def _tree_damaged(what: str) -> str:
    return rf"The sidecar in \S+ is damaged: {what}"


def test_records_that_disagree_are_damage_not_a_skeleton_mismatch(tree):
    def forget_b(c):
        root = c["nodes"][""]
        root["children"], root["keys"] = ["a", "d"], ["a", "d"]

    sidecars.edit(tree, forget_b)
    with pytest.raises(oeqx.CheckpointDamagedError) as info:
        oeqx.restore(tree, allow=[])
    text = str(info.value)
    assert text == (
        f"The sidecar in {tree} is damaged: its records of the tree disagree with "
        "its records of the leaves:\n"
        "  - Leaf `b` is in its leaf records but not in the tree the sidecar's "
        "nodes record.\n"
        "Restore an earlier step, or restore this one flat (without `allow=`) or "
        "into a skeleton."
    )
    assert "skeleton" not in text.split("\n")[1]
    assert oeqx.restore(tree)["b"] == 3  # flat, it still reads


_HOSTILE = {
    "unhashable-key": (
        lambda c: c["nodes"]["d"].update(keys=[{"list": [1]}]),
        r"the dict at `d` has a key \[1\] that is not hashable \(a list\), which no "
        r"save records",
    ),
    "key-twice": (
        lambda c: c["nodes"][""].update(keys=["a", "a", "d"]),
        r"dict node '' has a key twice",
    ),
    "absurd-dtype": (
        lambda c: c["nodes"]["d"].update(keys=[{"dtype": "S99999999999999999999999"}]),
        r"the value at `d` is unknown dtype 'S99999999999999999999999'",
    ),
    "respelled-dtype": (
        lambda c: c["nodes"]["d"].update(keys=[{"dtype": "f4"}]),
        r"the value at `d` is dtype 'f4', which a save writes as 'float32'",
    ),
    "malformed-value": (
        lambda c: c["nodes"]["d"].update(keys=[{"tuple": 3}]),
        r"the value at `d` is malformed",
    ),
}


@pytest.mark.parametrize("edit, what", _HOSTILE.values(), ids=_HOSTILE.keys())
def test_inspect_and_rebuild_say_what_is_wrong(tree, capsys, edit, what):
    sidecars.edit(tree, edit)
    with pytest.raises(oeqx.CheckpointDamagedError, match=_tree_damaged(what)):
        oeqx.restore(tree, allow=[])
    assert main(["inspect", str(tree)]) == 0
    out = capsys.readouterr().out
    line = out.splitlines()[-1]
    assert line.startswith("Without a skeleton: not rebuildable: The sidecar in")
    assert "records no tree structure" not in out
    assert main(["inspect", "--json", str(tree)]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    assert item["rebuild"]["recorded"] is False
    assert "is damaged: " in item["rebuild"]["why"]


@pytest.mark.slow
def test_a_chain_of_100000_nodes_is_refused_quickly(tree, capsys):
    def chain(c, n=100_000):
        c["nodes"]["d"]["children"] = ["c0"]
        for i in range(n):
            c["nodes"][f"c{i}"] = {
                "path": f"c{i}",
                "type": "list",
                "children": [f"c{i + 1}"],
            }
        c["nodes"][f"c{n}"] = {"path": "end", "type": "list", "children": ["d.k"]}

    sidecars.edit(tree, chain)
    what = (
        r"records a tree nesting more than 10000 levels deep \(at node 'c9999'\): "
        r"deeper than JAX flattens, so no save wrote it, and a rebuild does not "
        r"make it\. Restore an earlier step"
    )
    with pytest.raises(oeqx.RebuildError, match=rf"The checkpoint at \S+ {what}"):
        oeqx.restore(tree, allow=[])
    assert main(["inspect", str(tree)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("Without a skeleton: not rebuildable: The checkpoint at")
    )
    assert len(oeqx.restore(tree)) == 3  # flat, it still reads


def test_a_sidecar_without_its_nodes_is_damage(tree):
    content = sidecars.read(tree)
    del content["nodes"]
    sidecars.write(tree, content)
    with pytest.raises(
        oeqx.CheckpointDamagedError, match="missing required field `nodes`"
    ):
        oeqx.restore(tree, allow=["equinox"])


def test_a_string_scalar_leaf_rebuilds_with_its_dtype(tmp_path):
    # Its stand-in had dtype `<U0` (numpy's empty string), and the restore
    # said it differed "in the skeleton".
    oeqx.save(tmp_path / "ckpt", {"v": np.str_("ab"), "w": np.bytes_(b"xyz")})
    restored = oeqx.restore(tmp_path / "ckpt", allow=[])
    assert restored == {"v": np.str_("ab"), "w": np.bytes_(b"xyz")}
    assert restored["v"].dtype == np.dtype("<U2")


def test_shared_wiring_rebuilds_after_resealing(tmp_path):
    # A control: resealing alone changes nothing of what a rebuild makes.
    model = zoo.shared_tied(KEY)
    oeqx.save(tmp_path / "ckpt", model)
    sidecars.edit(tmp_path / "ckpt", lambda c: None)
    restored = oeqx.restore(tmp_path / "ckpt", allow=["equinox", "zoo"])
    np.testing.assert_array_equal(restored(3), model(3))


def test_renames_with_allow_speak_of_the_rebuilt_tree(tree):
    # The checkpoint's `a` read into a `c` that the rebuilt tree lacks.
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.restore(tree, allow=[], renames={"a": "c"})
    text = str(info.value)
    assert "The entry 'c' of rule 0 " in text
    assert "matches no name (the names it sees look like `a`, `b`, `d.k`)" in text
    assert "skeleton" not in text
    # The rebuilt tree's `a` read from a `zz` that the checkpoint lacks.
    with pytest.raises(oeqx.BridgeError) as info:
        oeqx.restore(tree, allow=[], renames={"zz": "a"})
    text = str(info.value)
    assert (
        "Rule 0 of `renames=` renames the rebuilt tree's leaves (`a` -> `zz`) only "
        "to names the checkpoint lacks (its leaves are named like `a`, `b`, `d.k`)."
    ) in text
    assert "skeleton" not in text


# --- leaf records: where the bytes are -----------------------------------------
# Hostile leaf records: where a sidecar says a leaf's bytes are.
#
# A record that disagrees with Orbax's array store (shape, dtype, a leaf it
# lacks or one it holds unlisted), an enormous shape in the sidecar or in Orbax's
# own metadata, names that try to escape the checkpoint's directory (leaf
# names, alias targets, module names): each fails with a clear error, or is only
# a dict key, and touches nothing; nothing is allocated before the sizes are
# checked against the files.
#
# Sidecars are edited with their checksum recomputed (`tests/sidecars.py`),
# an attacker's leaf name stored under the key the format derives from it.


KEY_SAVE = jax.random.key(1)
KEY_SKELETON = jax.random.key(2)
PACK = re.compile(r"orbax_eqx~packed\.[0-9a-f]{16}\.0\.bin")  # the one pack file
HUGE = 2**40


def _pack(path):
    """The pack file of the checkpoint at `path` (its name holds the save's token)."""
    return path / oeqx.metadata(path).packs[0].file


def _unpacked(tmp_path, **options):
    """A checkpoint whose arrays are all in Orbax's array store."""
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    oeqx.save(path, item, pack=False, **options)
    return path, item


def _store(path):
    """The directory of the checkpoint's Orbax array store."""
    return path / f"orbax_eqx~arrays.{oeqx.metadata(path).token}"


def _ocdbt_write(path, key: str, edit) -> None:
    """Edits the JSON value at `key` in an OCDBT store, as a tamperer could."""

    async def run():
        base = f"file://{_store(path)}/"
        store = await ts.KvStore.open({"driver": "ocdbt", "base": base})
        value = json.loads((await store.read(key)).value)
        edit(value)
        await store.write(key, json.dumps(value).encode())

    asyncio.run(run())


# --- the sidecar and Orbax's array metadata disagree ---------------------------


def _leaf_set(name, field, value):
    def edit(content):
        content["leaves"][name][field] = value

    return edit


def _add_stored_leaf(content):
    record = dict(content["leaves"]["a"], path="['c']", key="c")
    content["leaves"]["c"] = record


def _drop_leaf(content):
    del content["leaves"]["b"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _leaf_set("a", "shape", [500]),
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[500\] in the sidecar but "
            r"<f4\[1000\] in Orbax's array store",
        ),
        (
            _leaf_set("a", "dtype", "int32"),
            r"Leaf `\['a'\]` \(leaf name `a`\) is int32\[1000\] in the sidecar but "
            r"<f4\[1000\] in Orbax's array store",
        ),
        (
            _add_stored_leaf,
            r"Leaf `\['c'\]` \(leaf name `c`\) is stored in Orbax's array store, says "
            r"the sidecar, but the store holds no array under key `c`",
        ),
        (
            _drop_leaf,
            r"Orbax's array store holds an array under key `b`, which the sidecar does "
            r"not list",
        ),
    ],
    ids=["shape", "dtype", "leaf_missing_from_store", "store_has_unlisted_array"],
)
def test_sidecar_disagrees_with_orbax_store(tmp_path, edit, match):
    path, _ = _unpacked(tmp_path)
    sidecars.edit(path, edit)
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"(?s)The checkpoint at .*ckpt\S* is damaged: its sidecar and Orbax's array "
        rf"store disagree \(1 difference\):\n  - {match}.*do not belong together.*"
        r"Restore an earlier step, or re-save the checkpoint\.",
    )


def test_only_the_leaves_being_read_are_compared(tmp_path):
    path, item = _unpacked(tmp_path)
    sidecars.edit(path, _leaf_set("a", "shape", [500]))
    skeleton = {"b": jax.ShapeDtypeStruct((4, 4), jnp.int32)}
    restored = oeqx.restore(path, skeleton, strict=False)
    np.testing.assert_array_equal(restored["b"], item["b"])


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "no_ocdbt"])
def test_leaves_named_like_orbax_files_pass_the_comparison(tmp_path, use_ocdbt):
    # Whether a store is OCDBT is decided as Orbax does, not by a file name
    # that a leaf name could also give.
    item = {n: jnp.arange(3.0) for n in ("d", "ocdbt.process_0", "manifest.ocdbt")}
    oeqx.save(tmp_path / "ckpt", item, pack=False, use_ocdbt=use_ocdbt)
    skeleton = eqx.filter_eval_shape(lambda: item)
    zoo.assert_same(oeqx.restore(tmp_path / "ckpt", skeleton), item)


@pytest.mark.slow
def test_orbax_metadata_comparison_passes_for_the_dtypes_entry_with_zarr3(tmp_path):
    item = zoo.dtypes(KEY_SAVE)
    oeqx.save(tmp_path / "ckpt", item, pack=False, use_zarr3=True)
    restored = oeqx.restore(tmp_path / "ckpt", zoo.skeleton(zoo.dtypes, KEY_SKELETON))
    zoo.assert_same(restored, item)


# --- enormous shapes -----------------------------------------------------------


def _huge_packed(content, shape=(HUGE,)):
    record = content["leaves"]["a"]
    size = int(np.prod(shape, dtype=object)) * 4
    record["shape"], record["nbytes"] = list(shape), size
    content["packs"][0]["nbytes"] = record["offset"] + size + 4096


def _packed(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)})
    return path


def test_enormous_sidecar_shape_fails_the_skeleton_check(tmp_path):
    path = _packed(tmp_path)
    sidecars.edit(path, _huge_packed)
    skeleton = {
        "a": jax.ShapeDtypeStruct((1000,), jnp.float32),
        "b": jax.ShapeDtypeStruct((4, 4), jnp.int32),
    }
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointMismatchError,
        r"Leaf `a` has shape \(1000,\) in the skeleton but \(1099511627776,\) "
        "in the checkpoint",
        skeleton,
    )


@pytest.mark.parametrize(
    "shape",
    [(HUGE,), (2**62, 2**62)],
    ids=["terabytes", "overflowing_int64"],
)
@pytest.mark.slow
def test_enormous_packed_leaf_is_refused_before_allocating(tmp_path, shape):
    path = _packed(tmp_path)
    sidecars.edit(path, lambda c: _huge_packed(c, shape))
    size = os.path.getsize(_pack(path))
    # A fresh interpreter: were the buffer allocated first, this must not abort
    # pytest. It needs no memory at all: the file is checked first.
    result = restore_in_child(path)
    assert result["type"] == "CheckpointDamagedError"
    assert re.search(
        rf"The pack file .*{PACK.pattern} has {size} bytes where \d+ were written: "
        "the checkpoint is damaged",
        result["message"],
    )


def test_enormous_sidecar_shape_of_orbax_leaf_is_refused(tmp_path):
    path, _ = _unpacked(tmp_path)
    sidecars.edit(path, _leaf_set("a", "shape", [HUGE]))
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1099511627776\] in the "
        r"sidecar but <f4\[1000\] in Orbax's array store",
    )


@pytest.mark.parametrize(
    "field, match",
    [
        (
            "shape",
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1000\] in the sidecar but "
            r"<f4\[1099511627776\] in Orbax's array store",
        ),
        (
            "chunks",
            r"Leaf `\['a'\]` \(leaf name `a`\) is float32\[1000\] but its chunks in "
            r"Orbax's array store are \[1099511627776\] .*larger than the array",
        ),
    ],
    ids=["orbax_shape", "orbax_chunks"],
)
@pytest.mark.slow
def test_enormous_orbax_metadata_is_refused_before_reading(tmp_path, field, match):
    path, _ = _unpacked(tmp_path)
    _ocdbt_write(path, "a/.zarray", lambda z: z.__setitem__(field, [HUGE]))
    before = snapshot(tmp_path)
    result = restore_in_child(path)
    assert snapshot(tmp_path) == before
    assert result["type"] == "CheckpointDamagedError"
    assert re.search(match, result["message"]), result["message"]


# --- names that try to escape the directory ------------------------------------


def _rename_leaf(old, new, key):
    def edit(content):
        leaves = content["leaves"]
        record = leaves.pop(old)
        if record.get("data") == "orbax":
            record["key"] = key
        leaves[new] = record

    return edit


def _sentinel(tmp_path):
    """A file where an escaping name would point, to see it is never touched."""
    sentinel = tmp_path / "sentinel"
    sentinel.write_bytes(b"do not touch")
    return sentinel


@pytest.mark.parametrize(
    "escape",
    ["../sentinel", "../../sentinel", "/{tmp}/sentinel", "a/../../sentinel"],
    ids=["up", "up_twice", "absolute", "down_and_up"],
)
@pytest.mark.parametrize(
    "layout", ["packed", "orbax", "orbax_no_ocdbt"], ids=["packed", "orbax", "files"]
)
def test_escaping_leaf_names_stay_inside(tmp_path, layout, escape):
    name = escape.format(tmp=str(tmp_path).strip("/"))
    path = tmp_path / "ckpt"
    item = {"a": jnp.arange(1000.0), "b": jnp.ones((4, 4), jnp.int32)}
    options = {"packed": {}, "orbax": {"pack": False}}.get(
        layout, {"pack": False, "use_ocdbt": False}
    )
    oeqx.save(path, item, **options)
    key = sidecars.storage_key(name)
    sidecars.edit(path, _rename_leaf("a", name, key))
    sentinel = _sentinel(tmp_path)
    before = snapshot(tmp_path)
    if layout == "packed":
        # A name is a dict key: the bytes come from the pack file, as recorded
        # (resealed, the edit is the writer's word), never from a path.
        restored = oeqx.restore(path)
        np.testing.assert_array_equal(restored[name], np.arange(1000.0))
    else:
        # The storage key is derived from the name, one path component: no array
        # is stored under it.
        with pytest.raises(
            oeqx.CheckpointDamagedError,
            match=rf"Leaf `\['a'\]` \(leaf name `{re.escape(name)}`\) is stored in "
            rf"Orbax's array store, says the sidecar, but the store holds no array "
            rf"under key `{re.escape(key)}`",
        ):
            oeqx.restore(path)
        assert "/" not in key and key != ".."
    assert snapshot(tmp_path) == before
    assert sentinel.read_bytes() == b"do not touch"


@pytest.mark.parametrize(
    "target", ["nope", "../sentinel", "/etc/passwd"], ids=["missing", "up", "absolute"]
)
def test_alias_of_a_name_that_is_no_leaf(tmp_path, target):
    path = tmp_path / "ckpt"
    oeqx.save(path, _tied())
    sidecars.edit(path, lambda c: _retarget_alias(c, target))
    _sentinel(tmp_path)
    fails_touching_nothing(
        tmp_path,
        path,
        oeqx.CheckpointDamagedError,
        rf"The sidecar in .*ckpt is damaged: leaf '.*' is an alias of "
        rf"{re.escape(repr(target))}, which is no stored array of the same shape and "
        "dtype. Restore an earlier step",
    )


def _tied():
    w = jnp.ones((3, 3))
    return {"x": w, "y": w}


def _retarget_alias(content, target):
    aliases = [r for r in content["leaves"].values() if r.get("data") == "alias"]
    assert aliases
    aliases[0]["alias_of"] = target


@pytest.mark.parametrize(
    "module", ["../../sentinel", "/etc", "layers/../../x"], ids=["up", "abs", "mixed"]
)
def test_escaping_module_names_are_only_dict_keys(tmp_path, module):
    path = tmp_path / "ckpt"
    model = zoo.mlp(KEY_SAVE)
    oeqx.save(path, model)
    sidecars.edit(path, lambda c: c["modules"].__setitem__(module, c["modules"][""]))
    sentinel = _sentinel(tmp_path)
    before = snapshot(tmp_path)
    flat = oeqx.restore(path)
    np.testing.assert_array_equal(flat["layers.0.weight"], model.layers[0].weight)
    assert module in oeqx.metadata(path).modules
    restored = oeqx.restore(path, eqx.filter_eval_shape(zoo.mlp, KEY_SKELETON))
    zoo.assert_same(restored, model)
    assert snapshot(tmp_path) == before
    assert sentinel.read_bytes() == b"do not touch"
