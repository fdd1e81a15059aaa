"""Hostile sidecar records: a zero-size leaf claiming a shape, JSON that
Python reads but orbax_eqx never writes (NaN, endless integers, endless
nesting), values of no dtype or type a save records, and records of the tree
that disagree or nest without end. Each is damage, said in one clear error of
our own (never a raw `TypeError`), before any array is read, by every reader:
a restore (flat, into a skeleton, rebuilt with `allow=`), `metadata`,
`verify`, and `orbax-eqx inspect`/`verify`/`export`.

Each edit is resealed (a checksum computed anew, as an attacker would:
`tests/sidecars.py`): these tests probe the reader's rules, not the seal.
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo
from entry import main

import orbax_eqx as oeqx

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
