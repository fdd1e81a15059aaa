"""Two processes call `oeqx.save` on one path at the same moment.

Each writes its checkpoint beside the path under a name of its own, so their
files never mix; then each swaps its checkpoint in. With `overwrite=True`
both swaps go through, one after the other: the path holds the later one,
whole; where the swap takes two renames, the one whose second rename finds
the other's checkpoint in place may fail instead, with `ConcurrentSaveError`.
Without it, the second finds a checkpoint there and fails with
`ConcurrentSaveError` (or, if it started after the first finished,
`CheckpointExistsError`), and the first one's stays. Nothing is left beside
the path, and no error is Orbax's raw one (it used to be a
`FileNotFoundError: ... commit_success.txt` when both wrote into Orbax's one
temporary directory).
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

import orbax_eqx as oeqx

from . import _procs

TRIALS = int(os.environ.get("ORBAX_EQX_REPLACE_TWO_WRITER_TRIALS", "8"))
SEED = 13
STARTUP_S = 15  # for both to start JAX and build their items
PERIOD_S = 2.5  # between trials
EXIT_S = 60  # after the last trial

ERRORS = {
    "ConcurrentSaveError": r"Another save to {path} (saved a checkpoint there while "
    r"this one ran|put its checkpoint there between this save's two renames), so "
    r"this save was not put in its place and its files were removed; the other "
    r"save's checkpoint is kept whole\.",
    "CheckpointExistsError": r"{path} already exists\. Pass `overwrite=True`",
}


def _run(base):
    start_at = time.time() + STARTUP_S
    procs, logs = [], []
    for who in (0, 1):
        logs.append(base / f"writer-{who}.log")
        argv = [sys.executable, str(_procs.HERE / "_replace_two_writers_worker.py")]
        argv += [base, who, start_at, TRIALS, PERIOD_S, SEED]
        with open(logs[-1], "w") as out:
            procs.append(
                subprocess.Popen(
                    list(map(str, argv)),
                    env=_procs.worker_env(2),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=base,
                    start_new_session=True,
                )
            )
    deadline = start_at + TRIALS * PERIOD_S + EXIT_S
    try:
        for p, log in zip(procs, logs, strict=True):
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a writer hung:\n{log.read_text()[-3000:]}")
            assert p.returncode == 0, log.read_text()[-3000:]
    finally:
        for p in procs:
            _procs._kill(p)
    return [json.loads((base / f"outcome-{w}.json").read_text()) for w in (0, 1)]


def _whole(path) -> int:
    """`path` holds one writer's item, whole; returns which writer."""
    assert oeqx.verify(path).ok
    flat = oeqx.restore(path)
    who = flat["who"]
    for i in range(8):
        for kind in ("packed", "sharded"):
            values = flat[f"{kind}.{i}"]
            assert float(values.min()) == float(values.max()) == who * 10 + i
    assert int(flat["numpy"].min()) == int(flat["numpy"].max()) == who
    return who


def test_two_processes_saving_one_path_at_once(tmp_path):
    for trial in range(0, TRIALS, 2):  # overwrite=True: a checkpoint is there
        oeqx.save(tmp_path / f"trial-{trial}" / "ckpt", {"who": 9})
    outcomes = _run(tmp_path)
    tally = {"both saved": 0, "one saved": 0, "errors": {}}
    for trial in range(TRIALS):
        path = tmp_path / f"trial-{trial}" / "ckpt"
        results = [outcomes[w][trial] for w in (0, 1)]
        context = f"trial {trial}: {results}"
        assert os.listdir(path.parent) == ["ckpt"], context  # nothing beside it
        who = _whole(path)
        saved = [w for w, r in enumerate(results) if r["ok"]]
        assert who in saved, context
        if trial % 4 == 0 or (trial % 2 == 0 and len(saved) == 2):
            # Overwrites both go through, one after the other.
            assert saved == [0, 1], context
            tally["both saved"] += 1
            continue
        assert len(saved) == 1, context
        loser = results[1 - who]
        assert loser["type"] in ERRORS, context
        pattern = ERRORS[loser["type"]].format(path=path)
        assert re.search(pattern, loser["message"]), context
        tally["errors"][loser["type"]] = tally["errors"].get(loser["type"], 0) + 1
        tally["one saved"] += 1
    print(f"{TRIALS} trials: {tally}")
    # Mostly at the same moment: the race was run, not only sequential saves.
    assert tally["errors"].get("ConcurrentSaveError", 0) >= TRIALS // 4, tally
