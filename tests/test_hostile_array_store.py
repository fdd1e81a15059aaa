"""What is no file, or no readable one, in a checkpoint's directory and in
Orbax's array store (`pack=False`): a FIFO, a link to `/dev/zero`, more
entries than any store holds, and files or directories this user cannot read.
Each is refused before anything blocks or reads without end, in one clear
error, and `verify` says "cannot be read" rather than call a good checkpoint
damaged. (The check a save makes of the store just before its commit, and
the cap on its entries, lowered: `tests/test_storage_units.py`.)
"""

import os
import re
import shutil
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from children import restore_in_child, run_child
from unblock import raised_by
from untouched import snapshot

import orbax_eqx as oeqx

SIDECAR = "orbax_eqx.json"


def _pack(path):
    return path / oeqx.metadata(path).packs[0].file


def _unpacked(tmp_path, **options):
    path = tmp_path / "ckpt"
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    oeqx.save(path, {"model": model, "n": 3}, pack=False, **options)
    return path


def _store(path):
    return path / f"orbax_eqx~arrays.{oeqx.metadata(path).token}"


def _damaged_store(path, planted, what):
    return (
        f"Orbax's array store of the checkpoint at {re.escape(str(path))} holds "
        f"{re.escape(str(planted))}, which is {what} where Orbax writes only regular "
        r"files and directories\. Reading it could block forever or without end, so "
        r"nothing was read: the checkpoint is damaged \(or something else was put in "
        r"its place\)\. Restore an earlier step, or re-save the checkpoint\."
    )


def _replace_with(planted, plant):
    planted.unlink()
    plant(planted)


@pytest.mark.parametrize(
    "where, plant, what",
    [
        # A chunk file of the OCDBT data: the reads of the arrays open it.
        (
            lambda store: sorted((store / "ocdbt.process_0" / "d").iterdir())[0],
            os.mkfifo,
            r"a FIFO \(named pipe\)",
        ),
        # Orbax's own metadata, read before any array.
        (
            lambda store: store / "_METADATA",
            lambda p: os.symlink("/dev/zero", p),
            "a symbolic link to a character device",
        ),
    ],
    ids=["fifo_chunk", "dev_zero_metadata"],
)
@pytest.mark.slow
def test_array_store_entry_that_would_never_end_fails_fast(
    tmp_path, where, plant, what
):
    path = _unpacked(tmp_path)
    planted = where(_store(path))
    _replace_with(planted, plant)
    runs = run_child(
        path=str(path),
        out=str(tmp_path / "out" / "api"),
        cli={
            "cli verify": ["verify", str(path)],
            "cli inspect": ["inspect", str(path)],
        },
    )
    message = _damaged_store(path, planted, what)
    for name in ("restore", "export"):
        assert runs[name]["type"] == "CheckpointDamagedError", runs[name]
        assert re.fullmatch(message, runs[name]["message"]), runs[name]["message"]
    # verify: every Orbax-stored array is damaged, and says why.
    problems = runs["verify"]["value"]
    assert len(problems) == 4
    assert all(re.fullmatch(f"cannot be read: {message}", p) for p in problems)
    verified = runs["cli verify"]
    assert verified["code"] == 1 and verified["stdout"].count("DAMAGED") == 4
    assert re.search(message, verified["stdout"])
    # inspect reads the sidecar only: the tree is shown whole, nothing blocks.
    inspected = runs["cli inspect"]
    assert inspected["code"] == 0 and inspected["stderr"] == "", inspected
    assert inspected["stdout"].count("  Orbax") == 4
    assert "Total: 7 leaves, 4 arrays, 200 B." in inspected["stdout"]


def test_array_store_fifo_of_an_array_not_read_is_not_walked(tmp_path):
    # Without OCDBT each array has its directory; a partial restore walks, and
    # reads, only those of the arrays it asks for.
    path = tmp_path / "ckpt"
    oeqx.save(
        path, {"a": jnp.arange(3.0), "b": jnp.ones(4)}, pack=False, use_ocdbt=False
    )
    store = _store(path)
    fifo = store / "b" / "0"
    _replace_with(fifo, os.mkfifo)
    skeleton = jax.ShapeDtypeStruct((3,), jnp.float32)
    got = []

    def partial():
        got.append(oeqx.restore(path, skeleton, prefix="a"))

    assert raised_by(partial, fifo) is None
    assert got[0].tolist() == [0.0, 1.0, 2.0]
    # Asked for, the array's FIFO is refused.
    raised = raised_by(lambda: oeqx.restore(path), fifo)
    assert isinstance(raised, oeqx.CheckpointDamagedError)
    assert re.fullmatch(
        _damaged_store(path, fifo, r"a FIFO \(named pipe\)"), str(raised)
    )


# --- permissions ---------------------------------------------------------------


@pytest.mark.parametrize("run", ["restore", "verify"])
@pytest.mark.parametrize("what", ["directory", "sidecar", "pack", "store", "data"])
@pytest.mark.slow
def test_unreadable_checkpoint(tmp_path, what, run):
    # Unreadable is not damaged: `verify` raises too, rather than report a leaf
    # as damaged (which could get a good checkpoint deleted).
    if os.geteuid() == 0:
        # Root reads anything: restore as nobody, in a directory nobody can reach.
        base = tempfile.mkdtemp(prefix="oeqx-perm-")
        os.chmod(base, 0o755)
    else:
        base = str(tmp_path)
    try:
        path = os.path.join(base, "ckpt")
        # "store", "data": Orbax's array store, or a data file in it.
        stored = what in ("store", "data")
        oeqx.save(
            path, {"w": jnp.arange(8.0 if not stored else 100_000)}, pack=not stored
        )
        shutil.copytree(path, os.path.join(base, "warm"))
        for dirpath, dirnames, filenames in os.walk(base):
            for n in dirnames:
                os.chmod(os.path.join(dirpath, n), 0o755)
            for n in filenames:
                os.chmod(os.path.join(dirpath, n), 0o644)
        targets = {"directory": path, "sidecar": os.path.join(path, SIDECAR)}
        if stored:
            targets["store"] = os.fspath(_store(Path(path)))
            data = Path(targets["store"]).glob("ocdbt.process_0/d/*")
            targets["data"] = os.fspath(max(data, key=os.path.getsize))
        target = targets.get(what) or os.fspath(_pack(Path(path)))
        os.chmod(target, 0o000)
        before = snapshot(base) if os.geteuid() != 0 else None
        if os.geteuid() == 0:
            warm = os.path.join(base, "warm")
            result = restore_in_child(path, warm, 65534, run)
            kind, message = result["type"], result["message"]
        else:
            with pytest.raises(PermissionError) as info:
                getattr(oeqx, run)(path)
            kind, message = type(info.value).__name__, str(info.value)
            assert isinstance(info.value, PermissionError)
        os.chmod(target, 0o755 if what in ("directory", "store") else 0o644)
        if before is not None:
            assert snapshot(base) == before
        assert kind == "CheckpointPermissionError", message
        # The file that could not be read: in an unreadable store, the first
        # one TensorStore tried.
        named = message.removeprefix("Permission denied: ").split(" cannot be ")[0]
        assert named == target or (
            what == "store" and named.startswith(target + os.sep)
        ), message
        assert message == (
            f"Permission denied: {named} cannot be read by this user. Check the "
            "permissions of the checkpoint's directory and files (`ls -l`), or run "
            "as the user that saved it."
        )
    finally:
        if base != str(tmp_path):
            shutil.rmtree(base)
