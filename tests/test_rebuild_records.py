"""Hostile or damaged records of the tree, met by a rebuild (`allow=`) and by
`inspect`: each says what is wrong, in our own error, never a raw one, and
never speaks of a skeleton where there is none.

Sidecars are edited with their checksum recomputed (`tests/sidecars.py`), as
an attacker would: what is probed is the rebuild's rules.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sidecars
import zoo
from console import main as cli_main

import orbax_eqx as oeqx

KEY = jax.random.key(0)


def _damaged(what: str) -> str:
    return rf"The sidecar in \S+ is damaged: {what}"


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, {"a": np.ones(2), "b": 3, "d": {"k": jnp.ones(2)}})
    return path


def test_records_that_disagree_are_damage_not_a_skeleton_mismatch(saved):
    def forget_b(c):
        root = c["nodes"][""]
        root["children"], root["keys"] = ["a", "d"], ["a", "d"]

    sidecars.edit(saved, forget_b)
    with pytest.raises(oeqx.SidecarError) as info:
        oeqx.restore(saved, allow=[])
    text = str(info.value)
    assert text == (
        f"The sidecar in {saved} is damaged: its records of the tree disagree with "
        "its records of the leaves:\n"
        "  - Leaf `b` is in its leaf records but not in the tree the sidecar's "
        "nodes record.\n"
        "Restore an earlier step, or restore this one flat (without `allow=`) or "
        "into a skeleton."
    )
    assert "skeleton" not in text.split("\n")[1]
    assert oeqx.restore(saved)["b"] == 3  # flat, it still reads


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
def test_inspect_and_rebuild_say_what_is_wrong(saved, capsys, edit, what):
    sidecars.edit(saved, edit)
    with pytest.raises(oeqx.SidecarError, match=_damaged(what)):
        oeqx.restore(saved, allow=[])
    assert cli_main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    line = out.splitlines()[-1]
    assert line.startswith("Without a skeleton: not rebuildable: The sidecar in")
    assert "records no tree structure" not in out
    assert cli_main(["inspect", "--json", str(saved)]) == 0
    (item,) = json.loads(capsys.readouterr().out)["items"]
    assert item["rebuild"]["recorded"] is False
    assert "is damaged: " in item["rebuild"]["why"]


@pytest.mark.slow
def test_a_chain_of_100000_nodes_is_refused_quickly(saved, capsys):
    def chain(c, n=100_000):
        c["nodes"]["d"]["children"] = ["c0"]
        for i in range(n):
            c["nodes"][f"c{i}"] = {
                "path": f"c{i}",
                "type": "list",
                "children": [f"c{i + 1}"],
            }
        c["nodes"][f"c{n}"] = {"path": "end", "type": "list", "children": ["d.k"]}

    sidecars.edit(saved, chain)
    what = (
        r"records a tree nesting more than 10000 levels deep \(at node 'c9999'\): "
        r"deeper than JAX flattens, so no save wrote it, and a rebuild does not "
        r"make it\. Restore an earlier step"
    )
    with pytest.raises(oeqx.RebuildError, match=rf"The checkpoint at \S+ {what}"):
        oeqx.restore(saved, allow=[])
    assert cli_main(["inspect", str(saved)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("Without a skeleton: not rebuildable: The checkpoint at")
    )
    assert len(oeqx.restore(saved)) == 3  # flat, it still reads


def test_inspect_of_a_format_without_nodes_says_so(saved, capsys):
    content = sidecars.read(saved)
    del content["nodes"]
    sidecars.write(saved, content)
    assert cli_main(["inspect", str(saved)]) == 0
    assert capsys.readouterr().out.endswith(
        "Without a skeleton: not rebuildable (this sidecar records no tree "
        "structure; re-save to get one).\n"
    )


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


def test_renames_with_allow_speak_of_the_rebuilt_tree(saved):
    with pytest.raises(oeqx.RenameError) as info:
        oeqx.restore(saved, allow=[], renames={"a": "c"})
    text = str(info.value)
    assert "only to names the rebuilt tree lacks (its leaves are named like" in text
    assert "skeleton" not in text
