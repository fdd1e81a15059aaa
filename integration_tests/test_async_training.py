"""Async saves under a training loop: what the loop may do while a save is in
flight, and what it sees when a background write fails.

A save is held in flight by a gate on the sidecar write, the last thing a
save writes before Orbax commits (a private hook, on purpose: the only way
to pause a real save at a known point without timing). Faults are real: a
step directory removed under a save, a full filesystem.
"""

import os
import shutil
import signal
import subprocess
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import orbax_eqx as oeqx
from orbax_eqx._format import sidecar_write as _sidecar_write

from ._models import assert_trees_equal

LIMIT_S = 60  # no call here may block longer: a deadlock fails, not hangs
OPTIM = optax.adam(1e-2)


@pytest.fixture
def gate(monkeypatch):
    """Holds every sidecar write until the test sets the returned event."""
    event = threading.Event()
    write = _sidecar_write.write

    def gated_write(directory, content, *rest):
        if not event.wait(LIMIT_S):
            raise TimeoutError("the test never opened the sidecar gate")
        write(directory, content, *rest)

    # Internal: no public hook holds a save in flight at a known point.
    monkeypatch.setattr(_sidecar_write, "write", gated_write)
    yield event
    event.set()  # never leave a background save hanging


def _within(fn, *args, **kwargs):
    """Calls `fn(...)`; fails the test if it blocks past LIMIT_S (a deadlock).

    On this thread, not a helper one: Orbax raises a background error again on
    the main thread if another thread saw it first.
    """

    def interrupt(signum, frame):
        raise TimeoutError(f"{fn} blocked for {LIMIT_S} s: deadlock")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _until(condition):
    while not condition():
        time.sleep(0.01)


def _open_later(gate, seconds=0.3):
    timer = threading.Timer(seconds, gate.set)
    timer.start()
    return timer


def _make_state(key):
    model = eqx.nn.MLP(64, 64, 256, 2, key=key)
    opt_state = OPTIM.init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": 0}


def _skeleton():
    return eqx.filter_eval_shape(_make_state, jax.random.key(1234))


def _state(seed):
    state = _make_state(jax.random.key(seed))
    state["step"] = seed
    return state


def _snapshot(tree):
    """A deep host copy: what the checkpoint must hold, whatever happens next."""
    return jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, tree)


def _as_jax(tree):
    return jax.tree.map(
        lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, tree
    )


def _manager(root):
    return ocp.CheckpointManager(root, item_handlers=oeqx.EqxHandler())


def _restore(mngr, step):
    return _within(mngr.restore, step, args=oeqx.EqxRestore(_skeleton()))


def _check_on_disk(root, expected: dict):
    """A fresh manager sees exactly `expected`'s steps, each intact; no leftovers."""
    assert sorted(os.listdir(root)) == sorted(str(s) for s in expected)
    fresh = _manager(root)
    assert fresh.all_steps() == sorted(expected)
    for step, state in expected.items():
        assert_trees_equal(_restore(fresh, step), _as_jax(state))
    fresh.close()


def test_donated_deleted_and_mutated_arrays_after_save(tmp_path, gate):
    state = _state(1)
    state["data_stats"] = np.arange(8.0)  # numpy, updated in place below
    expected = _snapshot(state)
    mngr = _manager(tmp_path)
    assert mngr.save(1, args=oeqx.EqxSave(state))
    assert mngr.is_saving_in_progress()  # held at the gate

    # The training step takes ownership of the saved buffers.
    params, static = eqx.partition(state["model"], eqx.is_array)
    old_leaves = jax.tree.leaves(params)

    def train_step(params, opt_state, x):
        def loss(params):
            return jnp.mean(jax.vmap(eqx.combine(params, static))(x) ** 2)

        updates, opt_state = OPTIM.update(jax.grad(loss)(params), opt_state)
        return optax.apply_updates(params, updates), opt_state

    donating = jax.jit(train_step, donate_argnums=(0, 1))
    x = jnp.ones((4, 64))
    params, opt_state = donating(params, state["opt_state"], x)
    assert all(leaf.is_deleted() for leaf in old_leaves)
    for _ in range(3):
        params, opt_state = donating(params, opt_state, x)
    state["data_stats"] *= -1
    del state
    assert mngr.is_saving_in_progress()

    gate.set()
    _within(mngr.wait_until_finished)
    skeleton = _skeleton()
    skeleton["data_stats"] = np.zeros(8)
    restored = _within(mngr.restore, 1, args=oeqx.EqxRestore(skeleton))
    # As saved: jax arrays as jax arrays, the numpy one as numpy.
    assert_trees_equal(
        restored, {**_as_jax(expected), "data_stats": expected["data_stats"]}
    )
    trained = eqx.combine(params, static)
    assert not np.array_equal(
        trained.layers[0].weight, expected["model"].layers[0].weight
    )
    mngr.close()


def test_second_save_while_first_in_flight(tmp_path, gate):
    """One manager: the second save waits for the first (Orbax keeps one in
    flight). Two managers: both in flight at once. All four steps commit."""
    first, second = _manager(tmp_path / "a"), _manager(tmp_path / "b")
    states = {step: _state(step) for step in (1, 2, 3, 4)}
    expected = {step: _snapshot(s) for step, s in states.items()}
    assert first.save(1, args=oeqx.EqxSave(states[1]))
    assert second.save(3, args=oeqx.EqxSave(states[3]))
    assert first.is_saving_in_progress() and second.is_saving_in_progress()
    timer = _open_later(gate)
    assert _within(first.save, 2, args=oeqx.EqxSave(states[2]))
    assert gate.is_set()  # it could not have returned before step 1 was done
    assert _within(second.save, 4, args=oeqx.EqxSave(states[4]))
    for mngr in (first, second):
        _within(mngr.wait_until_finished)
        _within(mngr.close)
    timer.join()
    _check_on_disk(tmp_path / "a", {1: expected[1], 2: expected[2]})
    _check_on_disk(tmp_path / "b", {3: expected[3], 4: expected[4]})


def test_restore_previous_step_while_saving(tmp_path, gate):
    states = {1: _state(1), 2: _state(2)}
    expected = {step: _snapshot(s) for step, s in states.items()}
    mngr = _manager(tmp_path)
    gate.set()
    mngr.save(1, args=oeqx.EqxSave(states[1]))
    _within(mngr.wait_until_finished)
    gate.clear()
    assert mngr.save(2, args=oeqx.EqxSave(states[2]))
    assert mngr.is_saving_in_progress()

    # Another reader (an eval job) sees step 1 whole and no trace of step 2.
    reader = _manager(tmp_path)
    assert _within(reader.all_steps) == [1]
    reader.close()
    assert_trees_equal(
        _within(oeqx.restore, tmp_path / "1", _skeleton()), _as_jax(expected[1])
    )
    with pytest.raises(oeqx.CheckpointNotFoundError):
        oeqx.restore(tmp_path / "2", _skeleton())

    # The saving manager's own restore waits for the save in flight (Orbax's
    # choice), so it returns once the gate opens: no deadlock.
    timer = _open_later(gate)
    assert_trees_equal(_restore(mngr, 1), _as_jax(expected[1]))
    assert gate.is_set()
    assert_trees_equal(_restore(mngr, 2), _as_jax(expected[2]))
    _within(mngr.close)
    timer.join()
    _check_on_disk(tmp_path, expected)


def _close_while_in_flight(mngr, gate):
    timer = _open_later(gate)
    _within(mngr.close)
    assert gate.is_set()
    timer.join()


def _wait_from_two_threads_then_close(mngr, gate):
    waiters = [threading.Thread(target=mngr.wait_until_finished) for _ in range(2)]
    for w in waiters:
        w.start()
    gate.set()
    for w in waiters:
        w.join(LIMIT_S)
        assert not w.is_alive()
    _within(mngr.wait_until_finished)
    _within(mngr.close)


def _close_twice(mngr, gate):
    gate.set()
    _within(mngr.close)
    _within(mngr.close)


def _wait_close_then_wait(mngr, gate):
    gate.set()
    _within(mngr.wait_until_finished)
    _within(mngr.close)
    _within(mngr.wait_until_finished)


@pytest.mark.parametrize(
    "finish",
    [
        _close_while_in_flight,
        _wait_from_two_threads_then_close,
        _close_twice,
        _wait_close_then_wait,
    ],
    ids=["close-in-flight", "wait-from-two-threads", "close-twice", "wait-after-close"],
)
def test_wait_and_close_at_any_moment(tmp_path, gate, finish):
    states = {1: _state(1), 2: _state(2)}
    expected = {step: _snapshot(s) for step, s in states.items()}
    mngr = _manager(tmp_path)
    gate.set()
    mngr.save(1, args=oeqx.EqxSave(states[1]))
    _within(mngr.wait_until_finished)  # or step 1's write may meet a shut gate
    gate.clear()
    assert mngr.save(2, args=oeqx.EqxSave(states[2]))
    assert mngr.is_saving_in_progress()
    finish(mngr, gate)
    _check_on_disk(tmp_path, expected)


def _squat_sidecar_name(root, step):
    """Puts a directory where the held sidecar write of `step` must put its file."""
    item = None

    def found():
        nonlocal item
        steps = [p for p in root.iterdir() if p.name.startswith(f"{step}.orbax")]
        items = [p for s in steps for p in s.iterdir() if p.name.startswith("default")]
        item = items[0] if items else None
        return item is not None

    _within(_until, found)
    (item / "orbax_eqx.json").mkdir()


@pytest.mark.parametrize("surfaces_on", ["wait_until_finished", "save", "close"])
def test_background_error_names_the_step(tmp_path, gate, surfaces_on):
    states = {1: _state(1), 2: _state(2), 3: _state(3)}
    expected = {step: _snapshot(s) for step, s in states.items()}
    mngr = _manager(tmp_path)
    gate.set()
    mngr.save(1, args=oeqx.EqxSave(states[1]))
    _within(mngr.wait_until_finished)
    gate.clear()
    mngr.save(2, args=oeqx.EqxSave(states[2]))
    _squat_sidecar_name(tmp_path, 2)  # a real OS error when the write goes on
    gate.set()

    with pytest.raises(IsADirectoryError) as info:
        if surfaces_on == "save":
            _within(_until, lambda: not mngr.is_saving_in_progress())  # failed
            _within(mngr.save, 3, args=oeqx.EqxSave(states[3]))
        elif surfaces_on == "close":
            _within(mngr.close)
        else:
            _within(mngr.wait_until_finished)
    assert "orbax_eqx.json" in str(info.value)
    assert info.value.__notes__ == [
        f"orbax_eqx: this error stopped the background save of step `2` "
        f"({tmp_path}/2/default). That step was not committed; the steps saved "
        "before it are intact."
    ]
    # The manager goes on: the failed step is not listed, the next one saves.
    if surfaces_on == "close":
        mngr = _manager(tmp_path)
    assert mngr.all_steps() == [1]
    mngr.save(3, args=oeqx.EqxSave(states[3]))
    _within(mngr.wait_until_finished)
    _within(mngr.close)
    leftover = [p.name for p in tmp_path.iterdir() if p.name.startswith("2.")]
    for name in leftover:  # Orbax leaves the failed step's temporary directory
        shutil.rmtree(tmp_path / name)
    _check_on_disk(tmp_path, {1: expected[1], 3: expected[3]})


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB filesystem of its own (needs root to mount; skipped otherwise)."""
    path = tmp_path / "small"
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", os.fspath(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here: {e}")
    try:
        yield path
    finally:
        subprocess.run(["umount", os.fspath(path)], check=False)


def test_disk_full_in_background_array_write_names_the_step(small_disk):
    root = small_disk / "ckpt"
    mngr = _manager(root)
    small = {"w": jnp.arange(10.0)}
    mngr.save(1, args=oeqx.EqxSave(small))
    _within(mngr.wait_until_finished)
    big = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}  # 4 MiB
    assert mngr.save(2, args=oeqx.EqxSave(big))  # returns: the write is behind
    with pytest.raises(
        (OSError, ValueError),  # the pack's write, or Orbax's
        match=r"(?s)No space left on device.*step `2` \(.*/ckpt/2/default\)",
    ):
        _within(mngr.wait_until_finished)
    assert mngr.all_steps() == [1]
    skeleton = jax.eval_shape(lambda: small)
    assert_trees_equal(_within(mngr.restore, 1, args=oeqx.EqxRestore(skeleton)), small)
    _within(mngr.close)
