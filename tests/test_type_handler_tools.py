"""`inspect` and `verify` read checkpoints written through
`oeqx.type_handler_registry()` (no sidecar: the type handler's indexes), and
`verify` of a manager root says what it checks before its progress bar."""

import contextlib
import io
import json

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from entry import main

import orbax_eqx as oeqx

TREE = {"params": {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones(3)}, "step": 3}


def _handler():
    registry = oeqx.type_handler_registry()
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


@pytest.fixture
def item(tmp_path):
    with ocp.Checkpointer(_handler()) as checkpointer:
        checkpointer.save(tmp_path / "item", args=ocp.args.PyTreeSave(TREE))
    return tmp_path / "item"


@pytest.fixture
def root(tmp_path):
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=_handler()) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.PyTreeSave(TREE))
    return tmp_path / "run"


def test_inspect_reads_a_type_handler_item(item, capsys):
    assert main(["inspect", str(item)]) == 0
    out = capsys.readouterr().out
    assert f"Checkpoint {item}\n" in out
    assert "    w     float32  (4, 3)   48 B  pack       unsharded" in out
    assert "Total: 2 leaves, 2 arrays, 60 B." in out
    assert "Written through `oeqx.type_handler_registry()` by orbax_eqx " in out
    assert (
        "Only its jax arrays are shown: Orbax's own handler stored the other "
        "leaves, and reads them back." in out
    )
    assert main(["inspect", str(item), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["items"][0]["leaves"]) == ["params.b", "params.w"]


def test_inspect_reads_a_type_handler_manager_root(root, capsys):
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"CheckpointManager root {root}: 2 step(s)" in out
    assert f"Checkpoint {root}/2/default\n" in out


def test_verify_checks_a_type_handler_item(item, capsys):
    report = oeqx.verify(item)
    assert report.ok and sorted(report.checked) == ["params.b", "params.w"]
    assert main(["verify", str(item)]) == 0
    assert capsys.readouterr().out == (
        f"2 of 2 arrays (60 B) in {item} match their checksums.\n"
    )
    # A flipped bit in the group's pack is found, by leaf.
    (pack,) = item.glob("orbax_eqx~typed.*/orbax_eqx~packed.*.bin")
    data = bytearray(pack.read_bytes())
    data[0] ^= 1
    pack.write_bytes(bytes(data))
    report = oeqx.verify(item)
    assert [leaf.name for leaf in report.damaged] == ["params.b"]
    assert main(["verify", str(item)]) == 1


def test_verify_of_a_root_says_what_it_checks_before_the_progress_bar(root):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    with contextlib.redirect_stdout(term), contextlib.redirect_stderr(term):
        assert main(["verify", str(root)]) == 0
    text = term.getvalue()
    header = f"CheckpointManager root {root}: 2 step(s); checking every step."
    assert text.index(header) < text.index("\rverify [")
    assert text.rstrip().endswith(f"2 steps of {root}: every array matches.")


def test_restore_of_the_arrays_still_goes_through_orbax(item):
    with ocp.Checkpointer(_handler()) as checkpointer:
        restored = checkpointer.restore(item)
    np.testing.assert_array_equal(restored["params"]["w"], TREE["params"]["w"])


def test_restore_and_metadata_say_which_handler_reads_it(item, tmp_path):
    for call in (oeqx.metadata, oeqx.restore):
        for path in (item, tmp_path):  # the item, or a directory holding it
            with pytest.raises(
                oeqx.CheckpointNotFoundError,
                match=r"was saved through `oeqx.type_handler_registry\(\)` by Orbax's "
                r"own PyTreeCheckpointHandler, which writes no orbax_eqx sidecar: "
                r"restore it with that handler \(`ocp.PyTreeCheckpointHandler\(",
            ):
                call(path)
