"""kill -9 at any point of `save(..., overwrite=True)` never loses the checkpoint.

Each trial starts a process that overwrites one checkpoint again and again
(`_replace_crash_worker.py`), kills it with SIGKILL at a random moment
(seeded, so a failure can be replayed), then restores the path in this
process: it must hold, bit for bit, the version being saved when the kill
came or the one before, whichever the swap had reached. Half the rounds swap
by exchanging the two names in one call, half by the two renames used where
the system cannot (a kill between them leaves the old checkpoint beside the
path, which the restore renames back). What killed saves leave beside the
path never piles up, and a later save deletes it.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import orbax_eqx as oeqx

from ._replace_crash_worker import replace_item

WORKER = Path(__file__).with_name("_replace_crash_worker.py")
ROUNDS = int(os.environ.get("ORBAX_EQX_REPLACE_KILL_ROUNDS", "24"))
SEED = 20261313


def _holds(path, version) -> bool:
    """Whether `path` restores to exactly `replace_item(version)`."""
    flat = oeqx.restore(path)
    if flat["version"] != version:
        return False
    item = replace_item(version)
    assert flat["tag"] == item["tag"]
    expected = {f"layers.{i}": x for i, x in enumerate(item["layers"])}
    expected.update(table=item["table"], half=item["half"])
    for name, value in expected.items():
        got, want = np.asarray(flat[name]), np.asarray(value)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert got.tobytes() == want.tobytes(), name
    return True


def _start(path, swap):
    """A worker, started up and waiting for its first version (see `_go`)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(path), swap],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
        start_new_session=True,
    )


def _go(proc, first) -> list[str]:
    """Lets the worker start saving from version `first`; returns what it
    printed once it has started."""
    assert proc.stdout.readline().strip() == "ready", "worker did not start"
    proc.stdin.write(f"{first}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line.startswith("saving"), "worker did not start saving"
    return line.split()


def _kill(proc) -> list[str]:
    """SIGKILLs the worker; returns all it printed (nothing the second time)."""
    if proc.stdout.closed:
        return []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out = proc.stdout.read()
    proc.stdout.close()
    proc.stdin.close()
    proc.wait(timeout=60)
    return out.split()


def test_killed_overwrites_never_lose_the_checkpoint(tmp_path):
    rng = random.Random(SEED)
    path = tmp_path / "ckpt"
    oeqx.save(path, replace_item(0))
    latest, kinds, most_beside = 0, {"previous": 0, "new": 0}, 0
    swaps = [("exchange", "renames")[r % 2] for r in range(ROUNDS)]
    waiting = _start(path, swaps[0])  # each trial, the next one starts up
    try:
        for round_, swap in enumerate(swaps):
            proc = waiting
            printed = []
            try:
                printed = _go(proc, latest + 1)
                if round_ + 1 < ROUNDS:
                    waiting = _start(path, swaps[round_ + 1])
                time.sleep(rng.uniform(0.0, 2.0))
            finally:
                printed += _kill(proc)
            saving = max(int(w) for w in printed if w.isdigit())
            # What the kill left beside the path: at most one save's.
            beside = [n for n in os.listdir(tmp_path) if n != "ckpt"]
            most_beside = max(most_beside, len(beside))
            assert all(n.startswith(".ckpt.oeqx-") for n in beside), beside
            context = f"round {round_} ({swap}), killed saving {saving}: {beside}"
            if _holds(path, saving):
                kinds["new"] += 1
            else:
                assert _holds(path, saving - 1), context
                kinds["previous"] += 1
            latest = oeqx.metadata(path).leaves["version"].value
    finally:
        _kill(waiting)
    assert most_beside <= 2, most_beside
    # Both outcomes were seen: the kills fell before and after swaps.
    assert kinds["new"] and kinds["previous"], kinds
    # The next save deletes what the killed ones left.
    oeqx.save(path, replace_item(latest + 1), overwrite=True)
    assert _holds(path, latest + 1)
    assert os.listdir(tmp_path) == ["ckpt"]
    print(f"{ROUNDS} kill points, outcomes {kinds}, at most {most_beside} beside")
