"""`save(..., overwrite=True)` and `import --overwrite` replace a checkpoint
whole, or not at all, and replace nothing that is not a checkpoint.

Crashes at every point of an overwrite, a full disk and two processes at once
are in `integration_tests/test_replace_*.py`; here, single-process: failed
saves, the states a crash leaves (made on disk as a crash leaves them), and
what a later save or restore does with them (the states made with the
save's own names beside the target: `tests/test_staged_faults.py`).
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from entry import main
from safetensors.numpy import save_file

import orbax_eqx as oeqx


def _item(seed: int) -> dict:
    """Several leaves of every kind a save writes, different for every seed."""
    key = jax.random.key(seed)
    return {
        "layers": [
            jax.random.normal(jax.random.fold_in(key, i), (32, 16)) for i in range(4)
        ],
        "bias": np.arange(8, dtype=np.int32) + seed,
        "half": jnp.full((5,), seed, jnp.bfloat16),
        "step": seed,
        "tag": f"seed-{seed}",
    }


def _assert_holds(path, seed: int) -> None:
    """`path` restores to exactly `_item(seed)`, bit for bit."""
    flat = oeqx.restore(path)
    expected = {
        **{f"layers.{i}": x for i, x in enumerate(_item(seed)["layers"])},
        **{k: v for k, v in _item(seed).items() if k != "layers"},
    }
    assert set(flat) == set(expected)
    for name, value in expected.items():
        if isinstance(value, (int, str)):
            assert flat[name] == value, name
        else:
            got, want = np.asarray(flat[name]), np.asarray(value)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# Orbax's store cannot hold the dtype: refused when the save starts.
BAD = {"bad": jnp.zeros(4, jnp.float8_e4m3)}
BAD_MESSAGE = r"dtype float8_e4m3, which Orbax's array store"


def test_a_failed_overwrite_keeps_the_old_checkpoint_whole(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(0))
    with pytest.raises(
        oeqx.UnsupportedLeafError,
        match=BAD_MESSAGE + r"[\s\S]*orbax_eqx: this save did not change "
        rf"{path}; its temporary files were removed\.",
    ):
        oeqx.save(path, {**_item(1), **BAD}, overwrite=True, pack=False)
    _assert_holds(path, 0)
    assert os.listdir(tmp_path) == ["ckpt"]
    # And the next overwrite goes through.
    oeqx.save(path, _item(2), overwrite=True)
    _assert_holds(path, 2)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    with pytest.raises(oeqx.UnsupportedLeafError, match=BAD_MESSAGE):
        oeqx.save(tmp_path / "ckpt", {**_item(1), **BAD}, pack=False)
    assert os.listdir(tmp_path) == []


def _user_files(tmp_path, path):
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    (path / "data").mkdir()
    return (
        r"a directory of other files \(data, notes\.txt; no orbax_eqx\.json in "
        r"it or its subdirectories\)"
    )


def _a_file(tmp_path, path):
    path.write_text("mine")
    return r"a file"


def _a_link(tmp_path, path):
    oeqx.save(tmp_path / "real", _item(0))
    path.symlink_to(tmp_path / "real")
    return rf"a symbolic link \(to {tmp_path}/real\)"


def _a_manager_root(tmp_path, path):
    with ocp.CheckpointManager(path, item_handlers=oeqx.EqxHandler()) as mngr:
        for step in (0, 1):
            mngr.save(step, args=oeqx.EqxSave({"w": jnp.ones(2)}))
        mngr.wait_until_finished()
    return r"a CheckpointManager root \(steps 0, 1\)"


NOT_CHECKPOINTS = {
    "user-files": _user_files,
    "file": _a_file,
    "link": _a_link,
    "manager-root": _a_manager_root,
}


def _listing(tmp_path):
    return sorted(
        (
            os.path.relpath(os.path.join(d, f), tmp_path),
            os.path.getsize(os.path.join(d, f)),
        )
        for d, _, files in os.walk(tmp_path)
        for f in files
    )


def _refusal(path, found):
    return (
        rf"Cannot replace {path}: it is {found}, not an orbax_eqx checkpoint, and "
        r"overwriting replaces only checkpoints; nothing was changed\. Choose "
        r"another directory, or move or delete it yourself if it is not needed\."
    )


@pytest.mark.parametrize("make", NOT_CHECKPOINTS.values(), ids=NOT_CHECKPOINTS)
def test_overwrite_refuses_what_is_not_a_checkpoint(tmp_path, make):
    path = tmp_path / "target"
    found = make(tmp_path, path)
    before = _listing(tmp_path)
    with pytest.raises(FileExistsError, match=_refusal(path, found)):
        oeqx.save(path, _item(1), overwrite=True)
    assert _listing(tmp_path) == before
    assert isinstance(FileExistsError("x"), (FileExistsError, FileExistsError))


def test_overwrite_names_every_checkpoint_and_entry_of_a_mixed_directory(tmp_path):
    path = tmp_path / "mixed"
    for name in ("a", "b", "c", "d"):
        oeqx.save(path / name, {"w": jnp.ones(2)})
    for name in ("x.txt", "y.txt", "z.txt", ".hidden"):
        (path / name).write_text("mine")
    with pytest.raises(
        FileExistsError,
        match=r"it is a directory holding the checkpoints a, b, c and 1 more beside "
        r"other entries \(\.hidden, x\.txt, y\.txt and 1 more\), not an "
        r".* To replace a checkpoint in it, save to its path \(such as "
        rf"{path}/a\) instead; else choose another directory\.$",
    ):
        oeqx.save(path, _item(1), overwrite=True)
    assert len(os.listdir(path)) == 8


def _step(tmp_path, items):
    """Step 0 of a CheckpointManager root with these orbax_eqx items: a
    directory of item directories and the files Orbax writes beside them."""
    root = tmp_path / "root"
    handlers = {name: oeqx.EqxHandler() for name in items}
    with ocp.CheckpointManager(
        root, item_names=tuple(items), item_handlers=handlers
    ) as mngr:
        saved = {name: oeqx.EqxSave({"w": jnp.ones(2)}) for name in items}
        mngr.save(0, args=ocp.args.Composite(**saved))
        mngr.wait_until_finished()
    return root / "0"


@pytest.mark.parametrize("items", [["default"], ["model", "opt"]], ids=["1", "2"])
def test_overwrite_replaces_a_step_of_checkpoints_whole(tmp_path, items):
    step = _step(tmp_path, items)
    # What Orbax writes beside the items, all of it known to the check.
    assert sorted(os.listdir(step)) == sorted(
        ["_CHECKPOINT_METADATA", "commit_success.txt", *items]
    )
    oeqx.save(step, _item(1), overwrite=True)
    _assert_holds(step, 1)
    assert os.listdir(tmp_path / "root") == ["0"]


def test_overwrite_refuses_a_step_with_an_item_of_another_handler(tmp_path):
    step = tmp_path / "root" / "0"
    with ocp.CheckpointManager(
        tmp_path / "root",
        item_names=("model", "meta"),
        item_handlers={"model": oeqx.EqxHandler(), "meta": ocp.JsonCheckpointHandler()},
    ) as mngr:
        mngr.save(
            0,
            args=ocp.args.Composite(
                model=oeqx.EqxSave({"w": jnp.ones(2)}), meta=ocp.args.JsonSave({"a": 1})
            ),
        )
        mngr.wait_until_finished()
    before = _listing(tmp_path)
    with pytest.raises(
        FileExistsError,
        match=r"it is a directory holding the checkpoint model beside other entries "
        r"\(meta\), not an orbax_eqx checkpoint",
    ):
        oeqx.save(step, _item(1), overwrite=True)
    assert _listing(tmp_path) == before


def _safetensors(tmp_path):
    save_file({"w": np.arange(4, dtype=np.float32)}, tmp_path / "t.safetensors")
    (tmp_path / "models.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def skeleton():\n"
        "    return {'w': jax.ShapeDtypeStruct((4,), jnp.float32)}\n"
    )
    return str(tmp_path / "t.safetensors"), f"{tmp_path / 'models.py'}:skeleton"


@pytest.mark.parametrize("make", [_user_files, _a_file], ids=["user-files", "file"])
def test_import_overwrite_refuses_what_is_not_a_checkpoint(tmp_path, capsys, make):
    source, skeleton = _safetensors(tmp_path)
    out = tmp_path / "out"
    found = make(tmp_path, out)
    before = _listing(tmp_path)
    code = main(["import", source, str(out), "--skeleton", skeleton, "--overwrite"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.fullmatch("orbax_eqx: error: " + _refusal(out, found) + "\n", err), err
    assert _listing(tmp_path) == before
