"""One of two processes that save standalone checkpoints to the same paths at
the same moments.

    python _replace_two_writers_worker.py BASE WHO START_AT TRIALS PERIOD SEED

Trial `i` saves `item(WHO)` to BASE/trial-<i>/ckpt with `oeqx.save`, with
`overwrite=True` in even trials (the test put a checkpoint there first) and
without in odd ones; trials 2 and 3 of every 4 swap with two renames, as where
the kernel cannot exchange two names in one call. Trial `i` starts at
wall-clock START_AT + i * PERIOD plus a delay of 0 to 60 ms drawn from SEED
(the same draws in both writers: one of them gets the delay). Writes what
happened in each trial to BASE/outcome-<WHO>.json: {"ok": true}, or the
error's type and message.
"""

import json
import random
import sys
import time
import traceback
from pathlib import Path

from _worker import start

args = start("base", "who", "start_at", "trials", "period", "seed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from orbax_eqx._save import replace  # noqa: E402

EXCHANGE = replace._renameat2
WHO = int(args.who)
BASE = Path(args.base)


def item(who: int) -> dict:
    """Every value says which writer saved it: ~2 MiB packed, ~2 MiB in
    Orbax's store (a sharded array per layer), a numpy array, a Python int."""
    mesh = jax.make_mesh((2,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    return {
        "who": who,
        "packed": [jnp.full((128, 512), who * 10 + i, jnp.float32) for i in range(8)],
        "sharded": [
            jax.device_put(jnp.full((128, 512), who * 10 + i, jnp.float32), rows)
            for i in range(8)
        ],
        "numpy": np.full((64,), who, np.int32),
    }


def main() -> None:
    tree = jax.block_until_ready(item(WHO))
    outcomes = []
    for trial in range(int(args.trials)):
        delays = [0.0, random.Random(int(args.seed) + trial).uniform(0.0, 0.06)]
        if trial % 4 >= 2:
            delays.reverse()
        at = float(args.start_at) + trial * float(args.period) + delays[WHO]
        time.sleep(max(0.0, at - time.time()))
        path = BASE / f"trial-{trial}" / "ckpt"
        replace._renameat2 = EXCHANGE if trial % 4 < 2 else lambda: None
        try:
            oeqx.save(path, tree, overwrite=trial % 2 == 0)
            outcome = {"ok": True}
        except Exception as e:  # recorded for the test to judge
            outcome = {"ok": False, "type": type(e).__name__, "message": str(e)}
            outcome["traceback"] = traceback.format_exc()[-3000:]
        outcomes.append(outcome)
    (BASE / f"outcome-{WHO}.json").write_text(json.dumps(outcomes))
    print("done", flush=True)


main()
sys.exit(0)
