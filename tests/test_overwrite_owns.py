"""Overwrite deletes only what orbax_eqx and Orbax wrote.

A checkpoint directory that also holds a user's files (an exported
`model.safetensors`, `notes.txt`, `eval_results/`), or a folder of
checkpoints each saved on its own, is refused with every such entry named;
nothing is changed. A checkpoint holding only its own files (also a step of
a CheckpointManager, and old formats whose arrays Orbax stored in the item
directory itself) is replaced as before.
"""

import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from entry import main

import orbax_eqx as oeqx

DATA = Path(__file__).parent / "data"


def _item(seed):
    return {"w": jnp.arange(4.0) + seed, "b": np.arange(3) + seed}


def _listing(root):
    return sorted(
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(root)
        for f in files
    )


def _refusal(path, found):
    return (
        rf"^Cannot replace {path}: it is {found}, not an orbax_eqx checkpoint, and "
        r"overwriting replaces only checkpoints; nothing was changed\. "
    )


def _notes(path):
    (path / "notes.txt").write_text("mine")
    return ["notes.txt"]


def _eval_results(path):
    (path / "eval_results").mkdir()
    (path / "eval_results" / "scores.json").write_text("{}")
    return ["eval_results"]


def _exported(path):
    assert main(["export", str(path), str(path), "--to", "safetensors"]) == 0
    return ["model.safetensors"]


def _named_like_ours(path):
    (path / "orbax_eqx_notes.txt").write_text("mine")  # not `orbax_eqx~...`
    return ["orbax_eqx_notes.txt"]


def _all_three(path):
    return sorted(_notes(path) + _eval_results(path) + _exported(path))


@pytest.mark.parametrize(
    "add",
    [_notes, _eval_results, _exported, _named_like_ours, _all_three],
    ids=["notes", "eval-results", "exported", "named-like-ours", "all"],
)
def test_overwrite_refuses_a_checkpoint_holding_files_it_did_not_write(tmp_path, add):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(0))
    added = add(path)
    before = _listing(tmp_path)
    found = (
        r"a directory holding a checkpoint's files and entries neither orbax_eqx "
        rf"nor Orbax wrote \({', '.join(added)}\)"
    )
    with pytest.raises(
        FileExistsError,
        match=_refusal(path, found)
        + r"Overwriting deletes the whole directory: move those entries out of "
        r"it first, or choose another directory\.$",
    ):
        oeqx.save(path, _item(1), overwrite=True)
    assert _listing(tmp_path) == before
    restored = oeqx.restore(path, _item(5))
    assert restored["b"].tolist() == [0, 1, 2]
    # Moved out, the checkpoint is replaced.
    for name in added:
        shutil.move(path / name, tmp_path / name)
    oeqx.save(path, _item(1), overwrite=True)
    assert oeqx.restore(path, _item(5))["b"].tolist() == [1, 2, 3]


def test_overwrite_refuses_a_folder_of_checkpoints_each_saved_alone(tmp_path):
    folder = tmp_path / "folder"
    oeqx.save(folder / "exp1", _item(0))
    oeqx.save(folder / "exp2", _item(1))
    before = _listing(tmp_path)
    found = r"a directory of 2 checkpoint\(s\) each saved on its own \(exp1, exp2\)"
    with pytest.raises(
        FileExistsError,
        match=_refusal(folder, found)
        + rf"To replace one of them, save to its path \(such as {folder}/exp1\) "
        r"instead; else choose another directory\.$",
    ):
        oeqx.save(folder, _item(2), overwrite=True)
    assert _listing(tmp_path) == before


def test_overwrite_refuses_a_step_whose_item_holds_a_users_file(tmp_path):
    with ocp.CheckpointManager(
        tmp_path / "root", item_handlers=oeqx.EqxHandler()
    ) as mngr:
        mngr.save(0, args=oeqx.EqxSave(_item(0)))
        mngr.wait_until_finished()
    step = tmp_path / "root" / "0"
    (step / "default" / "notes.txt").write_text("mine")
    with pytest.raises(
        FileExistsError,
        match=r"it is a step of checkpoints whose item directories also hold "
        r"entries neither orbax_eqx nor Orbax wrote \(default/notes\.txt\)",
    ):
        oeqx.save(step, _item(1), overwrite=True)
    # The item directory itself: the same refusal.
    with pytest.raises(FileExistsError, match=r"\(notes\.txt\)"):
        oeqx.save(step / "default", _item(1), overwrite=True)
    assert (step / "default" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "options",
    [{}, {"pack": False}, {"pack": False, "use_ocdbt": False}],
    ids=["packed", "orbax", "orbax-files"],
)
def test_overwrite_replaces_a_checkpoint_of_its_own_files(tmp_path, options):
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(0), **options)
    oeqx.save(path, _item(1), overwrite=True, **options)
    assert oeqx.restore(path, _item(5))["b"].tolist() == [1, 2, 3]
