"""A save that another save of the same step overtook stops, clearly, and
takes nothing of the other's with it (`_save.claim`). The real race, two processes
at once, is in integration_tests/test_two_writers.py; here each way of losing
is staged, deterministically, by holding a save at a known point.

Internal modules imported here (`_format.sidecar`, `_save`,
`_storage.orbax_store.keys`, `_storage.packed`) are the units these tests pin,
or the only way to cause or observe the condition under test; everything else
goes through `orbax_eqx` and the `orbax-eqx` command.
"""

import os
import re
import shutil
import threading

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_eqx as oeqx
from orbax_eqx._format.sidecar import arrays_dir
from orbax_eqx._save import claim as _claim
from orbax_eqx._storage.orbax_store.keys import missing_in_store
from orbax_eqx._storage.packed import write as _packed_write

GATE_TIMEOUT_S = 60


@pytest.fixture
def held(monkeypatch):
    """Holds the pack writes of managers' saves until the test sets `release`;
    `reached` is set when one gets there (its directory exists, its arrays are
    copied). `oeqx.save`s go through."""
    reached, release = threading.Event(), threading.Event()
    write = _packed_write.write

    def held_write(path, *args, **kwargs):
        if "/default" not in str(path):
            return write(path, *args, **kwargs)
        reached.set()
        if not release.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never released the pack write")
        return write(path, *args, **kwargs)

    # Internal: no public hook pauses a save between its claim and its pack
    # write, where the race under test happens.
    monkeypatch.setattr(_packed_write, "write", held_write)
    yield reached, release
    release.set()


def _manager(root):
    return ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())


def _item(value):
    return {"w": jnp.full((4, 4), value), "step": int(value)}


MESSAGE = (
    r"Another save of the same step ran into .*5\.orbax-checkpoint-tmp.* at the "
    r"same time: {what}\. This save \(token [0-9a-f]{{16}}\) stopped and removed "
    r"its files, and is not committed; the other save's step is kept whole\. Two "
    r"jobs, or two CheckpointManagers, are saving to one checkpoint directory: "
    r"give each its own\."
)


# What a save of the same step that starts meanwhile does when it cannot
# delete the whole directory (the first save still writes in it): some of the
# first's files are gone, the directory is the same.
DELETED = (
    r"files this save had written were deleted while it ran \(Orbax deletes an "
    r"unfinished temporary directory when a save of the same step starts\); "
    r"gone: {gone}"
)


def _begun(tmp_path):
    """A save's item directory, and the save, begun in it: for staging on
    `_save.claim` itself."""
    directory = tmp_path / "5.orbax-checkpoint-tmp" / "default.orbax-checkpoint-tmp"
    directory.mkdir(parents=True)
    started = _claim.Started(epath.Path(directory), _claim.new_token())
    _claim.begin(started)
    return directory, started


def _claimed_sidecar(directory, started):
    """The save's sidecar, written (its token is all `_save.claim` reads of it)."""
    sidecar = directory / "orbax_eqx.json"
    sidecar.write_text(f'{{\n "token": "{started.token}"\n}}\n')
    _claim.wrote(started, sidecar)
    return sidecar


def test_a_save_whose_directory_was_replaced_stops(tmp_path):
    # Staged on `_save.claim` itself: through a manager, Orbax's own background
    # making of the directory races with the test's replacing it.
    directory, started = _begun(tmp_path)  # as its writes start
    # What a second save of step 5 does when it starts: delete, make anew.
    # (Made before the old one is deleted: a directory made after may get the
    # old one's inode number back, and only files this save wrote there would
    # tell, as the next test shows.)
    os.rename(directory.parent, tmp_path / "deleted")
    os.makedirs(directory)
    shutil.rmtree(tmp_path / "deleted")
    pack = directory / f"orbax_eqx~packed.{started.token}.0.bin"
    pack.write_bytes(b"written after the other save made the directory anew")
    what = r"its directory was deleted and made anew by the other save \(.*\)"
    with pytest.raises(RuntimeError, match=MESSAGE.format(what=what)):
        _claim.before_sidecar(started)
    assert os.listdir(directory) == []  # it removed what it wrote there


def test_a_save_whose_written_file_was_deleted_stops_before_its_sidecar(tmp_path):
    directory, started = _begun(tmp_path)
    pack = directory / f"orbax_eqx~packed.{started.token}.0.bin"
    pack.write_bytes(b"packed arrays")
    _claim.wrote(started, pack)
    pack.unlink()  # by the other save's Orbax, which then failed to delete the rest
    gone = rf"orbax_eqx~packed\.{started.token}\.0\.bin"
    with pytest.raises(
        RuntimeError, match=MESSAGE.format(what=DELETED.format(gone=gone))
    ):
        _claim.before_sidecar(started)


def test_a_losing_save_removes_its_own_sidecar_only(tmp_path):
    other = tmp_path / "other"
    oeqx.save(other, _item(2.0))
    directory, started = _begun(tmp_path)
    sidecar = _claimed_sidecar(directory, started)
    # The other save deleted this one's sidecar and put its own in its place
    # (which may even get the deleted one's inode number).
    sidecar.unlink()
    shutil.copy(other / "orbax_eqx.json", sidecar)
    with pytest.raises(RuntimeError):
        _claim.before_sidecar(started)
    assert oeqx.metadata(directory).token == oeqx.metadata(other).token


def test_a_sidecar_replaced_in_place_is_not_taken_for_ones_own(tmp_path):
    # The other save's sidecar at the same inode number, of the same size: as
    # when the deleted one's inode is reused. Only its token tells.
    directory, started = _begun(tmp_path)
    sidecar = _claimed_sidecar(directory, started)
    others = f'{{\n "token": "{_claim.new_token()}"\n}}\n'
    with open(sidecar, "r+") as f:
        f.write(others)
    what = DELETED.format(gone=r"orbax_eqx\.json")
    with pytest.raises(RuntimeError, match=MESSAGE.format(what=what)):
        _claim.before_sidecar(started)
    assert sidecar.read_text() == others  # the other's, kept


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "No such file or directory"),
        ValueError('NOT_FOUND: Error reading "w/0" in OCDBT database'),
        ValueError("No ArrayMetadata found for process_index=0"),
        ValueError("Save failed: 1/8 params are missing .zarray in checkpoint"),
    ],
    ids=["FileNotFoundError", "NOT_FOUND", "ArrayMetadata", "zarray"],
)
def test_errors_of_files_gone_missing_are_explained(tmp_path, error):
    # How Orbax and TensorStore fail when a save's files were deleted under it.
    directory, started = _begun(tmp_path)
    what = re.escape(_claim._DELETED)
    with pytest.raises(RuntimeError, match=MESSAGE.format(what=what)):
        _claim.explain(started, error)
    _claim.explain(started, ValueError("some other failure"))  # not explained


def test_a_save_whose_step_was_committed_meanwhile_stops(tmp_path, held):
    reached, release = held
    other = tmp_path / "other"
    oeqx.save(other, _item(2.0))
    mngr = _manager(tmp_path / "root")
    mngr.save(5, args=oeqx.EqxSave(_item(1.0)))
    assert reached.wait(GATE_TIMEOUT_S)
    shutil.copytree(other, tmp_path / "root" / "5" / "default")  # its commit
    release.set()
    what = r"the other save committed the step first, at .*root/5/default"
    with pytest.raises(RuntimeError, match=MESSAGE.format(what=what)):
        mngr.wait_until_finished()
    restored = oeqx.restore(tmp_path / "root" / "5" / "default")
    assert restored["step"] == 2 and float(restored["w"][0, 0]) == 2.0
    mngr.close()


def test_a_save_that_finds_the_others_sidecar_stops(tmp_path, held):
    reached, release = held
    other = tmp_path / "other"
    oeqx.save(other, _item(2.0))
    mngr = _manager(tmp_path / "root")
    mngr.save(5, args=oeqx.EqxSave(_item(1.0)))
    assert reached.wait(GATE_TIMEOUT_S)
    (tmp_dir,) = (tmp_path / "root").glob("5.*/default*")
    for name in os.listdir(other):  # the other save's files, claimed first
        shutil.copy(other / name, tmp_dir / name)
    release.set()
    what = "the other save's sidecar was already in it"
    with pytest.raises(RuntimeError, match=MESSAGE.format(what=what)):
        mngr.wait_until_finished()
    # The other's files are as they were; this save's pack is gone.
    assert sorted(os.listdir(tmp_dir)) == sorted(os.listdir(other))
    assert oeqx.restore(tmp_dir)["step"] == 2
    mngr.close()


@pytest.fixture
def held_commit(monkeypatch):
    """Holds managers' saves of step 5 just before their last check, in
    `finalize`, until the test sets `release`; `reached` is set when one gets
    there."""
    reached, release = threading.Event(), threading.Event()
    before_commit = _claim.before_commit

    def held(started):
        if "5.orbax-checkpoint-tmp" not in str(started.directory):
            return before_commit(started)
        reached.set()
        if not release.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never released the commit")
        return before_commit(started)

    # Internal: no public hook pauses a save just before its commit.
    monkeypatch.setattr(_claim, "before_commit", held)
    yield reached, release
    release.set()


def test_a_save_whose_pack_file_was_deleted_stops(tmp_path, held_commit):
    reached, release = held_commit
    mngr = _manager(tmp_path)
    mngr.save(4, args=oeqx.EqxSave(_item(4.0)))
    mngr.wait_until_finished()
    mngr.save(5, args=oeqx.EqxSave(_item(1.0)))
    assert reached.wait(GATE_TIMEOUT_S)
    (tmp_dir,) = tmp_path.glob("5.*/default*")
    (pack,) = tmp_dir.glob("orbax_eqx~packed.*")
    pack.unlink()
    release.set()
    what = DELETED.format(gone=r"orbax_eqx~packed\.[0-9a-f]{16}\.0\.bin")
    with pytest.raises(RuntimeError, match=MESSAGE.format(what=what)):
        mngr.wait_until_finished()
    assert not (tmp_path / "5").exists()
    assert [p.name for p in tmp_dir.iterdir()] == []  # its sidecar went too
    assert mngr.latest_step() == 4
    assert oeqx.restore(tmp_path / "4" / "default")["step"] == 4
    mngr.close()


def test_a_save_whose_stored_arrays_were_deleted_stops(tmp_path, held_commit):
    reached, release = held_commit
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=oeqx.EqxHandler(pack=False))
    # Large enough for a data file of its own (small values are kept inline).
    mngr.save(5, args=oeqx.EqxSave({"w": jnp.ones((256, 256)), "step": 5}))
    assert reached.wait(GATE_TIMEOUT_S)
    (tmp_dir,) = tmp_path.glob("5.*/default*")
    (arrays,) = tmp_dir.glob("orbax_eqx~arrays.*")
    data = [p for p in arrays.glob("ocdbt.process_*/d/*")]
    assert data
    for p in data:
        p.unlink()
    release.set()
    gone = r"array `w` in orbax_eqx~arrays\.[0-9a-f]{16}"
    with pytest.raises(
        RuntimeError, match=MESSAGE.format(what=DELETED.format(gone=gone))
    ):
        mngr.wait_until_finished()
    assert not (tmp_path / "5").exists()
    mngr.close()


STORE_FORMATS = {
    "ocdbt": {},
    "no-ocdbt": {"use_ocdbt": False},
    "zarr3": {"use_zarr3": True},
    "zarr3-no-ocdbt": {"use_ocdbt": False, "use_zarr3": True},
}


@pytest.mark.parametrize("options", STORE_FORMATS.values(), ids=STORE_FORMATS)
def test_the_commit_check_finds_what_left_orbaxs_store(tmp_path, options):
    """`missing_in_store`, which `before_commit` asks, in every store format:
    a whole store is whole; an array whose metadata record is gone, or (in an
    OCDBT store, where values live in shared data files) whose data file is
    gone, is named, and only it."""
    big = jnp.arange(65536.0).reshape(256, 256)
    item = {"big": big, "small": jnp.arange(3.0), "step": 5}
    path = tmp_path / "ckpt"
    oeqx.save(path, item, pack=False, **options)
    store = arrays_dir(epath.Path(path), oeqx.metadata(path).token)
    keys = ["big", "small"]
    assert missing_in_store(store, keys) == []
    if options.get("use_ocdbt", True):
        # `big` has a data file of its own; `small` is kept inline.
        for data in store.glob("ocdbt.process_*/d/*"):
            if os.path.getsize(data) > 256 * 256 * 4 // 2:
                data.unlink()
    else:
        meta = "zarr.json" if options.get("use_zarr3") else ".zarray"
        (store / "big" / meta).unlink()
    assert missing_in_store(store, keys) == ["big"]
    shutil.rmtree(store)
    assert missing_in_store(store, keys) == keys
