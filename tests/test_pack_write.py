"""The pack is written while the leaves are named (`_save/files.py`): a
save whose pack write or naming fails still fails whole, keeps the earlier
checkpoint, and leaves no write going on once it has raised; one that
succeeds writes what a save always wrote.

Internal modules imported here (`_save.prepare`, `_storage.packed.write`) are
the only way to make the pack write slow or failing, or the background walk
fail, at a known point; everything else goes through `orbax_eqx`.
"""

import os
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zoo

import orbax_eqx as oeqx
from orbax_eqx._save import prepare as _prepare
from orbax_eqx._storage.packed import write as _packed_write


def _item(value: float) -> dict:
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
    oeqx.save(path, _item(1.0))

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # Internal: the way to make the pack's write fail, as a full disk would.
    monkeypatch.setattr(_packed_write, "write", failing)
    with pytest.raises(OSError, match="No space left on device"):
        oeqx.save(path, _item(2.0), overwrite=True)
    assert not _pack_threads()
    monkeypatch.undo()
    zoo.assert_same(oeqx.restore(path, _item(0.0)), _item(1.0))


def test_failed_naming_waits_for_the_pack_write(tmp_path, monkeypatch, slow_pack):
    """The background walk fails while the (slow) pack write is under way: the
    save raises only once that write is over, and the earlier checkpoint is
    kept."""
    path = tmp_path / "ckpt"
    oeqx.save(path, _item(1.0))  # the structure is known: later saves walk late
    slow_pack.clear()

    def failing_walk(*args, **kwargs):
        raise RuntimeError("the walk failed here")

    # Internal: no public input fails the background walk of a tree whose
    # structure passed before (it checks what was checked already).
    monkeypatch.setattr(_prepare, "_walk_snapshot", failing_walk)
    with pytest.raises(RuntimeError, match="the walk failed here"):
        oeqx.save(path, _item(2.0), overwrite=True)
    raised = time.perf_counter()
    assert len(slow_pack) == 1 and slow_pack[0] <= raised
    assert not _pack_threads()
    monkeypatch.undo()
    zoo.assert_same(oeqx.restore(path, _item(0.0)), _item(1.0))


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
            item = _item(float(step))
            head[:] = step
            item["head"] = head  # the same buffer every time: changed below
            expected[step] = _item(float(step))
            mngr.save(step, args=oeqx.EqxSave(item))
            head[:] = -1.0  # the save holds its own copy
        mngr.wait_until_finished()
        assert len(slow_pack) == 4
        for step, want in expected.items():
            zoo.assert_same(mngr.restore(step, args=oeqx.EqxRestore(_item(-5.0))), want)
    assert not _pack_threads()


def test_the_pack_is_written_whoever_took_the_pieces_first(tmp_path):
    """`finish` (naming the leaves) may take the packed pieces before the pack
    write starts: the pack is still written, whole, with every checksum."""
    from etils import epath

    from orbax_eqx._save.files import start_pack

    item = _item(3.0)
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
