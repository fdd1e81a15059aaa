"""Host buffers of async saves' numpy copies, reused from one save to the next
(`_storage/transfer/pool.py`): never handed out twice at once, given back only
once the write that reads them is over (or failed), bounded, and let go when
not reused or when the manager closes; every step restores what it was given.

Internal modules imported here (`_storage.transfer.pool`, `_storage.packed.
write`) are the unit under test, or the only way to slow or fail a pack write
at a known point; a handler's pool (`EqxHandler._pool`) is read only to see
whether buffers are idle.
"""

import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zoo

import orbax_eqx as oeqx
from orbax_eqx._storage.packed import write as _packed_write
from orbax_eqx._storage.transfer import pool as _pool

BIG = _pool.MIN_BYTES // 4  # float32 elements: one pooled buffer


def _item(value: float) -> dict:
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
def slow_pack(monkeypatch):
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


def test_buffers_come_back_only_after_the_write(tmp_path, slow_pack):
    """While a save's pack is being written, its buffers are not idle (no
    other save could take them); once written they are, and the next save,
    of other values, reuses them and restores exactly; so does the first."""
    handler = oeqx.EqxHandler()
    slow_pack["during"] = handler._pool.idle_bytes
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handler) as mngr:
        item = _item(1.0)
        mngr.save(1, args=oeqx.EqxSave(item))
        item["a"][:] = -7.0  # the caller changes its arrays at once
        item["b"][:] = -7.0
        mngr.wait_until_finished()
        pooled = handler._pool.idle_bytes()
        assert pooled == item["a"].nbytes + item["b"].nbytes
        mngr.save(2, args=oeqx.EqxSave(_item(2.0)))
        mngr.wait_until_finished()
        assert slow_pack["seen"] == [0, 0]  # none idle while a write ran
        assert handler._pool.idle_bytes() == pooled  # the same ones, back
        zoo.assert_same(mngr.restore(1, args=oeqx.EqxRestore(_item(0.0))), _item(1.0))
        zoo.assert_same(mngr.restore(2, args=oeqx.EqxRestore(_item(0.0))), _item(2.0))
    assert handler._pool.idle_bytes() == 0  # closed with the manager


def test_a_failed_save_gives_its_buffers_back(tmp_path, monkeypatch):
    handler = oeqx.EqxHandler()

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handler) as mngr:
        mngr.save(1, args=oeqx.EqxSave(_item(1.0)))
        mngr.wait_until_finished()
        # Internal: the way to make the pack's write fail, as a full disk would.
        monkeypatch.setattr(_packed_write, "write", failing)
        mngr.save(2, args=oeqx.EqxSave(_item(2.0)))
        with pytest.raises(Exception, match="No space left on device"):
            mngr.wait_until_finished()
        monkeypatch.undo()
        assert handler._pool.idle_bytes() == 2 * BIG * 4 + BIG * 4
        mngr.save(3, args=oeqx.EqxSave(_item(3.0)))
        mngr.wait_until_finished()
        zoo.assert_same(mngr.restore(1, args=oeqx.EqxRestore(_item(0.0))), _item(1.0))
        zoo.assert_same(mngr.restore(3, args=oeqx.EqxRestore(_item(0.0))), _item(3.0))


def test_kept_copy_bytes_zero_keeps_nothing_between_saves(tmp_path):
    handler = oeqx.EqxHandler(kept_copy_bytes=0)
    with ocp.CheckpointManager(tmp_path / "run", item_handlers=handler) as mngr:
        for step in (1, 2):
            item = _item(float(step))
            mngr.save(step, args=oeqx.EqxSave(item))
            item["a"][:] = -7.0  # the caller changes its arrays at once
            mngr.wait_until_finished()
            assert handler._pool.idle_bytes() == 0
        for step in (1, 2):
            restored = mngr.restore(step, args=oeqx.EqxRestore(_item(0.0)))
            zoo.assert_same(restored, _item(float(step)))


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
