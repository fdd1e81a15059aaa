"""Faults staged inside the package at a known point: a save overtaken by
another save of its step, a pack write slowed or failing, the host buffers
such writes hold, the sidecar a save asks about after a failure, and the
errors of a background write or of another process of a restore; and an
async save held in flight at its sidecar (Orbax's v1 API); and the states a
crash or another save leaves beside a checkpoint being overwritten, made on
disk with the save's own names, and what a later save or restore does.

Reaches inside: no public call can hold, slow or fail a save at a chosen point.

The real races, crashes and processes are in `integration_tests/`
(`test_two_writers.py`, `test_replace_*.py`, `test_share.py`); here each is
staged, deterministically, through `_save`, `_storage` and `_restore`.
"""

import gc
import os
import re
import shutil
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_replace as replaced
import test_v1 as v1
import zoo
from entry import main
from etils import epath
from orbax.checkpoint import v1 as ocp_v1
from unblock import raised_by

import orbax_eqx as oeqx
from orbax_eqx._format import sidecar_write as _sidecar_write
from orbax_eqx._format.sidecar import arrays_dir
from orbax_eqx._restore.together import RestoreFailedElsewhereError, _error, together
from orbax_eqx._save import claim as _claim
from orbax_eqx._save import prepare as _prepare
from orbax_eqx._save import replace as _replace_module
from orbax_eqx._save.claim import _is_sidecar_of
from orbax_eqx._save.futures import target
from orbax_eqx._save.replace import (
    HOST,
    NEW,
    OLD,
    ORBAX_TMP,
    SWAP_WAIT_S,
    Owner,
    beside,
    new_owner,
    publish,
    saving,
)
from orbax_eqx._storage.orbax_store.keys import missing_in_store
from orbax_eqx._storage.packed import write as _packed_write
from orbax_eqx._storage.transfer import pool as _pool

# --- a save overtaken by another -----------------------------------------------
# A save that another save of the same step overtook stops, clearly, and
# takes nothing of the other's with it (`_save.claim`). The real race, two processes
# at once, is in integration_tests/test_two_writers.py; here each way of losing
# is staged, deterministically, by holding a save at a known point.


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


def _claim_item(value):
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
    oeqx.save(other, _claim_item(2.0))
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
    oeqx.save(other, _claim_item(2.0))
    mngr = _manager(tmp_path / "root")
    mngr.save(5, args=oeqx.EqxSave(_claim_item(1.0)))
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
    oeqx.save(other, _claim_item(2.0))
    mngr = _manager(tmp_path / "root")
    mngr.save(5, args=oeqx.EqxSave(_claim_item(1.0)))
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
    mngr.save(4, args=oeqx.EqxSave(_claim_item(4.0)))
    mngr.wait_until_finished()
    mngr.save(5, args=oeqx.EqxSave(_claim_item(1.0)))
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


def test_claim_reads_no_sidecar_that_is_a_fifo(tmp_path):
    # Whether a sidecar is this save's, asked after a failure: a FIFO there is
    # no save's (and a link is not followed), never waited on.
    fifo = tmp_path / "orbax_eqx.json"
    os.mkfifo(fifo)
    got = []
    assert raised_by(lambda: got.append(_is_sidecar_of(fifo, "0" * 16)), fifo) is None
    assert got == [False]
    real = tmp_path / "real.json"
    real.write_text('{"token": "0123456789abcdef"}')
    os.symlink(real, tmp_path / "link.json")
    assert _is_sidecar_of(real, "0123456789abcdef")
    assert not _is_sidecar_of(tmp_path / "link.json", "0123456789abcdef")


# --- a pack write slowed or failing --------------------------------------------
# The pack is written while the leaves are named (`_save/files.py`): a
# save whose pack write or naming fails still fails whole, keeps the earlier
# checkpoint, and leaves no write going on once it has raised; one that
# succeeds writes what a save always wrote.


def _pack_item(value: float) -> dict:
    return {
        "layers": [{"w": jnp.full((8, 8), value + i)} for i in range(20)],
        "head": np.full((3,), value, np.float32),
        "step": int(value),
    }


def _pack_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "orbax_eqx_pack"]


@pytest.fixture
def slow_pack(monkeypatch):
    """Pack writes that take a while (what the background naming overlaps);
    `done` lists each one's end, in order."""
    write = _packed_write.write
    done: list[float] = []

    def slow(*args, **kwargs):
        time.sleep(0.3)
        out = write(*args, **kwargs)
        done.append(time.perf_counter())
        return out

    # Internal: no public hook slows a pack write down.
    monkeypatch.setattr(_packed_write, "write", slow)
    return done


def test_failed_pack_write_keeps_the_earlier_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    oeqx.save(path, _pack_item(1.0))

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # Internal: the way to make the pack's write fail, as a full disk would.
    monkeypatch.setattr(_packed_write, "write", failing)
    with pytest.raises(OSError, match="No space left on device"):
        oeqx.save(path, _pack_item(2.0), overwrite=True)
    assert not _pack_threads()
    monkeypatch.undo()
    zoo.assert_same(oeqx.restore(path, _pack_item(0.0)), _pack_item(1.0))


def test_failed_naming_waits_for_the_pack_write(tmp_path, monkeypatch, slow_pack):
    """The background walk fails while the (slow) pack write is under way: the
    save raises only once that write is over, and the earlier checkpoint is
    kept."""
    path = tmp_path / "ckpt"
    oeqx.save(path, _pack_item(1.0))  # the structure is known: later saves walk late
    slow_pack.clear()

    def failing_walk(*args, **kwargs):
        raise RuntimeError("the walk failed here")

    # Internal: no public input fails the background walk of a tree whose
    # structure passed before (it checks what was checked already).
    monkeypatch.setattr(_prepare, "_walk_snapshot", failing_walk)
    with pytest.raises(RuntimeError, match="the walk failed here"):
        oeqx.save(path, _pack_item(2.0), overwrite=True)
    raised = time.perf_counter()
    assert len(slow_pack) == 1 and slow_pack[0] <= raised
    assert not _pack_threads()
    monkeypatch.undo()
    zoo.assert_same(oeqx.restore(path, _pack_item(0.0)), _pack_item(1.0))


def test_async_saves_back_to_back_with_a_slow_pack(tmp_path, slow_pack):
    """Saves of different values one right after the other, each changing its
    numpy leaf in place and donating nothing else once `save` returns, while
    the previous save's pack is still being written: each step restores the
    values it was given."""
    mngr = ocp.CheckpointManager(tmp_path / "run", item_handlers=oeqx.EqxHandler())
    head = np.zeros((3,), np.float32)
    expected = {}
    with mngr:
        for step in range(4):
            item = _pack_item(float(step))
            head[:] = step
            item["head"] = head  # the same buffer every time: changed below
            expected[step] = _pack_item(float(step))
            mngr.save(step, args=oeqx.EqxSave(item))
            head[:] = -1.0  # the save holds its own copy
        mngr.wait_until_finished()
        assert len(slow_pack) == 4
        for step, want in expected.items():
            zoo.assert_same(
                mngr.restore(step, args=oeqx.EqxRestore(_pack_item(-5.0))), want
            )
    assert not _pack_threads()


def test_the_pack_is_written_whoever_took_the_pieces_first(tmp_path):
    """`finish` (naming the leaves) may take the packed pieces before the pack
    write starts: the pack is still written, whole, with every checksum."""
    from etils import epath

    from orbax_eqx._save.files import start_pack

    item = _pack_item(3.0)
    prepared = _prepare.prepare(item, token="0123456789abcdef")
    prepared.finish()  # takes the pieces first
    pack = start_pack(epath.Path(tmp_path), "0123456789abcdef", prepared, True)
    assert pack is not None
    sums = pack.result()
    assert len(sums) == len(prepared.packed_names) == 21
    assert os.path.getsize(pack.path) == prepared.pack_nbytes
    data = np.fromfile(pack.path, np.uint8)
    for offset, host in prepared.pieces:
        got = data[offset : offset + host.nbytes].view(host.dtype).reshape(host.shape)
        np.testing.assert_array_equal(got, host)


# --- the host buffers of async saves -------------------------------------------
# Host buffers of async saves' numpy copies, reused from one save to the next
# (`_storage/transfer/pool.py`): never handed out twice at once, given back only
# once the write that reads them is over (or failed), bounded, and let go when
# not reused or when the manager closes; every step restores what it was given.


BIG = _pool.MIN_BYTES // 4  # float32 elements: one pooled buffer


def _pooled_item(value: float) -> dict:
    return {
        "a": np.full((BIG,), value, np.float32),
        "b": np.full((2, BIG), value + 0.5, np.float32),
        "small": np.full((5,), value, np.float32),
        "step": int(value),
    }


def _pointer(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


# The pool itself.


def test_a_buffer_is_never_handed_out_twice_at_once():
    pool = _pool.HostPool()
    x = np.arange(BIG, dtype=np.float32)
    one, two = pool.lease(), pool.lease()
    a, b = one.copy(x), two.copy(x)
    assert _pointer(a) != _pointer(b)
    one.give_back()
    c = two.copy(x)  # `one`'s buffer, idle now
    assert _pointer(c) == _pointer(a)
    d = pool.lease().copy(x)  # none idle: a new one
    assert len({_pointer(a), _pointer(b), _pointer(d)}) == 3
    for copy in (b, c, d):
        np.testing.assert_array_equal(copy, x)


def test_reuse_needs_the_same_size_and_small_copies_are_not_pooled():
    pool = _pool.HostPool()
    lease = pool.lease()
    big = lease.copy(np.ones((BIG,), np.float32))
    small = lease.copy(np.ones((7,), np.float32))
    lease.give_back()
    assert pool.idle_bytes() == big.nbytes  # the small copy was never pooled
    other = pool.lease().copy(np.ones((BIG + 1,), np.float32))
    assert _pointer(other) != _pointer(big)
    assert small.flags.c_contiguous and small.base is None


def test_copies_keep_dtype_shape_and_values():
    pool = _pool.HostPool()
    lease = pool.lease()
    cases = [
        np.arange(BIG, dtype=np.float32).reshape(BIG // 8, 8)[:, ::-1],  # strided
        np.arange(BIG // 2, dtype=">f8"),  # big-endian
        (np.arange(BIG * 4) % 3 == 0),  # bool
        np.arange(BIG * 2, dtype=np.float32).astype(jax.numpy.bfloat16),
    ]
    for x in cases:
        copy = lease.copy(x)
        assert copy.dtype == x.dtype and copy.shape == x.shape
        assert copy.flags.c_contiguous
        np.testing.assert_array_equal(copy, x)


def test_idle_buffers_are_bounded_and_let_go():
    nbytes = BIG * 4
    pool = _pool.HostPool(max_idle=2 * nbytes)
    lease = pool.lease()
    for _ in range(3):
        lease.copy(np.zeros((BIG,), np.float32))
    lease.give_back()
    assert pool.idle_bytes() == 2 * nbytes  # the third was let go
    # A save that reuses one lets go of the others it did not reuse.
    nxt = pool.lease()
    nxt.copy(np.zeros((BIG,), np.float32))
    nxt.done()
    assert pool.idle_bytes() == 0
    nxt.give_back()
    assert pool.idle_bytes() == nbytes
    pool.close()
    assert pool.idle_bytes() == 0
    late = pool.lease()
    late.copy(np.zeros((BIG,), np.float32))
    late.give_back()  # after close: let go, not kept
    assert pool.idle_bytes() == 0


def test_threads_taking_and_giving_back_never_share_a_buffer():
    pool = _pool.HostPool()
    x = np.ones((BIG,), np.float32)
    held: set[int] = set()
    lock = threading.Lock()
    problems: list[str] = []

    def worker() -> None:
        for _ in range(30):
            lease = pool.lease()
            copy = lease.copy(x)
            with lock:
                if _pointer(copy) in held:
                    problems.append("handed out twice")
                held.add(_pointer(copy))
            time.sleep(0.001)
            with lock:
                held.discard(_pointer(copy))
            lease.give_back()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not problems


# Through a CheckpointManager.


@pytest.fixture
def held_pack(monkeypatch):
    """Pack writes that wait `hold` seconds before writing; `during` runs
    while the first write waits."""
    write = _packed_write.write
    state = {"during": None, "seen": []}

    def slow(*args, **kwargs):
        during = state["during"]
        if during is not None:
            state["seen"].append(during())
        time.sleep(0.3)
        return write(*args, **kwargs)

    # Internal: no public hook holds a save's pack write.
    monkeypatch.setattr(_packed_write, "write", slow)
    return state


def test_buffers_come_back_only_after_the_write(tmp_path, held_pack):
    """While a save's pack is being written, its buffers are not idle (no
    other save could take them); once written they are, and the next save,
    of other values, reuses them and restores exactly; so does the first."""
    handler = oeqx.EqxHandler()
    held_pack["during"] = handler._pool.idle_bytes
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handler) as mngr:
        item = _pooled_item(1.0)
        mngr.save(1, args=oeqx.EqxSave(item))
        item["a"][:] = -7.0  # the caller changes its arrays at once
        item["b"][:] = -7.0
        mngr.wait_until_finished()
        pooled = handler._pool.idle_bytes()
        assert pooled == item["a"].nbytes + item["b"].nbytes
        mngr.save(2, args=oeqx.EqxSave(_pooled_item(2.0)))
        mngr.wait_until_finished()
        assert held_pack["seen"] == [0, 0]  # none idle while a write ran
        assert handler._pool.idle_bytes() == pooled  # the same ones, back
        zoo.assert_same(
            mngr.restore(1, args=oeqx.EqxRestore(_pooled_item(0.0))), _pooled_item(1.0)
        )
        zoo.assert_same(
            mngr.restore(2, args=oeqx.EqxRestore(_pooled_item(0.0))), _pooled_item(2.0)
        )
    assert handler._pool.idle_bytes() == 0  # closed with the manager


def test_a_failed_save_gives_its_buffers_back(tmp_path, monkeypatch):
    handler = oeqx.EqxHandler()

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handler) as mngr:
        mngr.save(1, args=oeqx.EqxSave(_pooled_item(1.0)))
        mngr.wait_until_finished()
        # Internal: the way to make the pack's write fail, as a full disk would.
        monkeypatch.setattr(_packed_write, "write", failing)
        mngr.save(2, args=oeqx.EqxSave(_pooled_item(2.0)))
        with pytest.raises(Exception, match="No space left on device"):
            mngr.wait_until_finished()
        monkeypatch.undo()
        assert handler._pool.idle_bytes() == 2 * BIG * 4 + BIG * 4
        mngr.save(3, args=oeqx.EqxSave(_pooled_item(3.0)))
        mngr.wait_until_finished()
        zoo.assert_same(
            mngr.restore(1, args=oeqx.EqxRestore(_pooled_item(0.0))), _pooled_item(1.0)
        )
        zoo.assert_same(
            mngr.restore(3, args=oeqx.EqxRestore(_pooled_item(0.0))), _pooled_item(3.0)
        )


def test_kept_copy_bytes_zero_keeps_nothing_between_saves(tmp_path):
    handler = oeqx.EqxHandler(kept_copy_bytes=0)
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handler) as mngr:
        for step in (1, 2):
            item = _pooled_item(float(step))
            mngr.save(step, args=oeqx.EqxSave(item))
            item["a"][:] = -7.0  # the caller changes its arrays at once
            mngr.wait_until_finished()
            assert handler._pool.idle_bytes() == 0
        for step in (1, 2):
            restored = mngr.restore(step, args=oeqx.EqxRestore(_pooled_item(0.0)))
            zoo.assert_same(restored, _pooled_item(float(step)))


@pytest.mark.parametrize(
    "value",
    [-1, 1.5, True, "8GiB", None],
    ids=["negative", "float", "bool", "str", "none"],
)
def test_kept_copy_bytes_must_be_a_number_of_bytes(value):
    with pytest.raises(
        ValueError,
        match=r"EqxHandler\(kept_copy_bytes=.*\): expected a number of bytes \(an "
        r"int, 0 or more\).*; found .*Pass kept_copy_bytes=0 to keep none, or "
        r"leave it out for the default \(8589934592 = 8 GiB\)",
    ):
        oeqx.EqxHandler(kept_copy_bytes=value)
    assert issubclass(ValueError, ValueError)


# --- which save a background write error names ---------------------------------


@pytest.mark.parametrize(
    "directory, expected",
    [
        (
            "/ckpts/3.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",
            "step `3` (/ckpts/3/default)",
        ),
        (
            "/ckpts/ckpt_12.orbax-checkpoint-tmp-1712/model.orbax-checkpoint-tmp-5",
            "step `ckpt_12` (/ckpts/ckpt_12/model)",
        ),
        ("/ckpts/model.orbax-checkpoint-tmp-1712", "/ckpts/model"),  # standalone
        ("/ckpts/7/default", "/ckpts/7/default"),  # finalized in place
    ],
    ids=["manager", "prefixed-step-composite", "standalone", "final"],
)
def test_target_names_the_step(directory, expected):
    assert target(epath.Path(directory)) == expected


# --- what every process of a restore raises ------------------------------------
# The error every process of a multi-process restore raises when one failed.
#
# The exchange itself needs several processes (`integration_tests/test_share.py`);
# here, what each outcome turns into, and that one process runs the restore as
# it is.


NOTE = r"\(Process 1 of 4 found this; every process of the restore stops with it\.\)"


def test_one_process_restores_as_it_is():
    assert together("/ckpt", lambda: 3) == 3
    with pytest.raises(KeyError):
        together("/ckpt", lambda: {}["x"])


@pytest.mark.parametrize(
    "outcome, kind, match",
    [
        (
            "CheckpointDamagedError\nThe shard pack x.bin is damaged.",
            oeqx.CheckpointDamagedError,
            rf"^The shard pack x\.bin is damaged\. {NOTE}$",
        ),
        (
            "ValueError\nbad index",
            RestoreFailedElsewhereError,
            rf"^Process 1 of 4 could not restore /ckpt: ValueError: bad index {NOTE}$",
        ),
        (
            # Made of other arguments than a message: the generic error.
            "ShardingRuleError\nno rule fits",
            RestoreFailedElsewhereError,
            rf"^Process 1 of 4 could not restore /ckpt: ShardingRuleError: no rule "
            rf"fits {NOTE}$",
        ),
        (
            None,
            RestoreFailedElsewhereError,
            r"^Process 1 of 4 did not finish its part of the restore of /ckpt within "
            r"300 s \(Orbax's coordination timeout\): it crashed, was killed, or is "
            r"still reading\. Look at that process's log; every process stops the "
            r"restore\.$",
        ),
    ],
    ids=["ours", "builtin", "other-constructor", "silent"],
)
def test_what_every_process_raises(outcome, kind, match):
    error = _error("/ckpt", 1, 4, outcome, 300)
    assert type(error) is kind and isinstance(error, oeqx.OrbaxEqxError)
    with pytest.raises(kind, match=match):
        raise error


# --- an async save held in flight --------------------------------------------


GATE_TIMEOUT_S = 60


@pytest.fixture
def sidecar_gate(monkeypatch):
    """Holds every sidecar write until the test sets the returned event.

    The sidecar is the last file a save writes before Orbax commits the
    checkpoint, so while the gate is shut the save is provably in flight.
    """
    gate = threading.Event()
    write = _sidecar_write.write

    def gated_write(directory, content, *rest):
        if not gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never opened the sidecar gate")
        write(directory, content, *rest)

    # Internal: no public hook holds a save in flight at a known point.
    monkeypatch.setattr(_sidecar_write, "write", gated_write)
    yield gate
    gate.set()  # never leave a background save hanging


def test_save_async_returns_before_writing_with_host_copies(tmp_path, sidecar_gate):
    path = tmp_path / "ckpt"
    item = {"model": zoo.transformer_block(v1.KEY_SAVE), "table": np.arange(6.0)}
    expected = {"model": zoo.transformer_block(v1.KEY_SAVE), "table": np.arange(6.0)}

    response = ocp_v1.save_checkpointables_async(path, {"train": item})
    with pytest.raises(TimeoutError):
        response.result(timeout=0.2)  # held at the sidecar: still in flight
    assert not path.exists()  # Orbax commits by renaming a temporary directory

    # Everything the caller may do once it returns: change numpy leaves in
    # place, donate the saved jax arrays (deleting their buffers), drop them.
    item["table"][...] = -1.0
    params, static = eqx.partition(item["model"], eqx.is_array)
    saved_arrays = jax.tree.leaves(params)
    update = jax.jit(lambda p: jax.tree.map(lambda w: w * 0 - 7, p), donate_argnums=0)
    params = update(update(params))
    assert all(x.is_deleted() for x in saved_arrays)
    item["model"] = eqx.combine(params, static)
    del item, params, static, saved_arrays
    gc.collect()

    sidecar_gate.set()
    response.result(timeout=GATE_TIMEOUT_S)
    skeleton = {"model": v1._block_skeleton(), "table": np.zeros(6)}
    zoo.assert_same(v1._load_state(path, skeleton), expected)


# --- an overwrite cut short, or raced ----------------------------------------


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_overwrite_swaps_in_the_new_checkpoint(tmp_path, exchange, monkeypatch):
    if not exchange:  # a system that cannot exchange two names at once
        monkeypatch.setattr(_replace_module, "_exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    oeqx.save(path, replaced._item(0))
    owner = new_owner()
    new = beside(path, owner, NEW)
    oeqx.save(new, replaced._item(1))  # as the save commits it, beside the old one
    publish(new, path, owner, overwrite=True)
    replaced._assert_holds(path, 1)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_checkpoint_another_save_put_there_meanwhile_is_kept(tmp_path):
    path = tmp_path / "ckpt"
    owner = new_owner()
    new = beside(path, owner, NEW)
    oeqx.save(new, replaced._item(1))
    with saving(owner):  # while this save runs, the other one saves
        oeqx.save(path, replaced._item(2))
    with pytest.raises(
        RuntimeError,
        match=rf"Another save to {path} saved a checkpoint there while this one "
        r"ran, so this save was not put in its place and its files were removed; "
        r"the other save's checkpoint is kept whole\. Two processes are saving to "
        r"one path: give each its own, or save one after the other\.",
    ):
        publish(new, path, owner, overwrite=False)
    replaced._assert_holds(path, 2)


def test_user_files_put_at_the_path_while_a_save_ran_are_kept(tmp_path):
    path = tmp_path / "ckpt"
    owner = new_owner()
    new = beside(path, owner, NEW)
    oeqx.save(new, replaced._item(1))
    path.mkdir()  # after the save checked the path, before it swaps
    (path / "notes.txt").write_text("mine")
    with pytest.raises(
        FileExistsError,
        match=rf"Cannot replace {path}: while this save ran it became a directory "
        r"of other files \(notes\.txt; no orbax_eqx\.json in it or its "
        r"subdirectories\); nothing was changed\. Choose another directory, or "
        r"move or delete it yourself if it is not needed\.",
    ):
        publish(new, path, owner, overwrite=True)
    assert os.listdir(path) == ["notes.txt"]


def test_overwrite_never_replaces_a_directory_that_merely_holds_a_checkpoint(
    tmp_path,
):
    # A project directory with a checkpoint in it: overwriting the project
    # once deleted the user's notes and data with it.
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    (project / "data").mkdir()
    (project / "data" / "table.csv").write_text("1,2\n")
    oeqx.save(project / "model", replaced._item(0))
    before = replaced._listing(tmp_path)
    found = (
        r"a directory holding the checkpoint model beside other entries \(data, "
        r"notes\.txt\)"
    )
    fix = (
        rf"To replace a checkpoint in it, save to its path \({project}/model\) "
        r"instead; else choose another directory\."
    )
    refusal = (
        rf"Cannot replace {project}: it is {found}, not an orbax_eqx checkpoint, "
        rf"and overwriting replaces only checkpoints; nothing was changed\. {fix}"
    )
    with pytest.raises(FileExistsError, match=f"^{refusal}$"):
        oeqx.save(project, replaced._item(1), overwrite=True)
    assert replaced._listing(tmp_path) == before
    replaced._assert_holds(project / "model", 0)
    # Found only at the swap (put there while the save ran): refused the same.
    owner = new_owner()
    new = beside(project, owner, NEW)
    oeqx.save(new, replaced._item(1))
    with pytest.raises(
        FileExistsError,
        match=rf"^Cannot replace {project}: while this save ran it became {found}; "
        rf"nothing was changed\. {fix}$",
    ):
        publish(new, project, owner, overwrite=True)
    assert (project / "notes.txt").read_text() == "mine"
    assert os.listdir(project / "data") == ["table.csv"]


def test_a_save_deletes_what_dead_saves_left_beside_it_and_nothing_else(tmp_path):
    path = tmp_path / "ckpt"
    oeqx.save(path, replaced._item(0))
    dead = Owner("0badc0de", replaced._dead_pid(), HOST)
    ended = Owner("0badf00d", os.getpid(), HOST)  # an earlier save of this process
    live = Owner("0000beef", os.getpid(), HOST)  # a save under way (below)
    elsewhere = Owner("12345678", 1, "another-host")  # cannot tell: kept
    for owner in (dead, ended, live, elsewhere):
        for made in (
            beside(path, owner, NEW),
            beside(path, owner, OLD),
            path.parent / (beside(path, owner, NEW).name + ORBAX_TMP),
        ):
            made.mkdir()
            (made / "orbax_eqx.json").write_text("{}")
    (tmp_path / ".ckpt.notes").write_text("the user's")
    kept = sorted(
        n for n in os.listdir(tmp_path) if dead.token not in n and ended.token not in n
    )
    assert len(kept) == 2 * 3 + 2
    with saving(live):
        oeqx.save(path, replaced._item(1), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == kept
    replaced._assert_holds(path, 1)


def _cut_swap(tmp_path, path, owner):
    """The state a save killed between `path -> OLD` and `NEW -> path` leaves."""
    oeqx.save(tmp_path / "a", replaced._item(0))
    os.rename(tmp_path / "a", beside(path, owner, OLD))
    oeqx.save(tmp_path / "b", replaced._item(1))
    os.rename(tmp_path / "b", beside(path, owner, NEW))


@pytest.mark.parametrize("by", ["restore", "metadata", "save", "overwrite"])
def test_a_swap_cut_between_its_renames_is_undone(tmp_path, by):
    path = tmp_path / "ckpt"
    _cut_swap(tmp_path, path, Owner("0badc0de", replaced._dead_pid(), HOST))
    if by == "restore":
        replaced._assert_holds(path, 0)
    elif by == "metadata":
        assert oeqx.metadata(path).leaves["tag"].value == "seed-0"
        replaced._assert_holds(path, 0)
    elif by == "save":
        with pytest.raises(FileExistsError, match="already exists"):
            oeqx.save(path, replaced._item(2))
        replaced._assert_holds(path, 0)
        assert os.listdir(tmp_path) == ["ckpt"]  # the dead save's NEW: deleted
    else:
        oeqx.save(path, replaced._item(2), overwrite=True)
        replaced._assert_holds(path, 2)
        assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.slow
def test_a_restore_gives_a_live_save_a_moment_to_finish_its_swap(tmp_path):
    # Its owner runs (this process), yet the swap never finishes: after the
    # moment, the replaced checkpoint is put back all the same.
    path = tmp_path / "ckpt"
    live = Owner("0000beef", os.getpid(), HOST)
    _cut_swap(tmp_path, path, live)
    start = time.monotonic()
    with saving(live):
        replaced._assert_holds(path, 0)
    assert time.monotonic() - start >= SWAP_WAIT_S


def test_import_overwrite_first_undoes_what_a_killed_one_left(tmp_path, capsys):
    source, skeleton = replaced._safetensors(tmp_path)
    out = tmp_path / "out"
    _cut_swap(tmp_path, out, Owner("0badc0de", replaced._dead_pid(), HOST))
    argv = ["import", source, str(out), "--skeleton", skeleton]
    assert main(argv) == 2  # the killed one's old checkpoint is back
    assert capsys.readouterr().err == (
        f"orbax_eqx: error: {out} already exists. Pass --overwrite to replace it, "
        "or choose another output.\n"
    )
    assert main([*argv, "--overwrite"]) == 0
    np.testing.assert_array_equal(oeqx.restore(out)["w"], np.arange(4.0))
    assert sorted(os.listdir(tmp_path)) == ["models.py", "out", "t.safetensors"]
