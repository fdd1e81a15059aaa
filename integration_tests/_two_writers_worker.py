"""One of two independent jobs that save the same step into one directory.

    python _two_writers_worker.py ROOT WHO DELAY DIRS TIMEOUT_S

Builds an item whose every array holds values of writer WHO (and a sharded
array, so Orbax's array store is written too, and a packed one), writes
`ready-WHO` in its working directory, waits for the test's `go` file (a start
time, written once both writers are ready) and DELAY seconds past it, saves
step 5 through its own
CheckpointManager, waits for it, and writes what happened to
ROOT/../outcome-WHO.json: {"ok": true} or the error's type and message.
DIRS is "sync" or "async": how Orbax makes the step's directories;
TIMEOUT_S is Orbax's `AsyncOptions.timeout_secs`.
"""

import faulthandler
import json
import os
import pathlib
import sys
import time
import traceback
from pathlib import Path

from _worker import start

args = start("root", "who", "delay", "dirs", "timeout_s")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

STEP = 5
WHO = int(args.who)
ROOT = Path(args.root)


def item(who: int):
    mesh = jax.make_mesh((2,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    return {
        "who": who,
        # ~8 MiB packed and ~8 MiB in Orbax's store: saves that overlap.
        "packed": [jnp.full((256, 1024), who * 10 + i, jnp.float32) for i in range(8)],
        "sharded": [
            jax.device_put(jnp.full((256, 1024), who * 10 + i, jnp.float32), rows)
            for i in range(8)
        ],
        "numpy": np.full((64,), who, np.int32),
    }


options = ocp.CheckpointManagerOptions(
    async_options=ocp.AsyncOptions(
        create_directories_asynchronously=args.dirs == "async",
        timeout_secs=int(args.timeout_s),
    )
)
mngr = ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler(), options=options)
tree = jax.block_until_ready(item(WHO))
# Both writers are ready before either starts (imports take longer under
# load): the test then writes `go`, the start time, and each waits its delay.
pathlib.Path(f"ready-{WHO}").touch()
waited = time.monotonic()
while not pathlib.Path("go").exists():
    if time.monotonic() - waited > 120:
        sys.exit("no go from the test within 120 s")
    time.sleep(0.005)
start_at = float(pathlib.Path("go").read_text()) + float(args.delay)
time.sleep(max(0.0, start_at - time.time()))
began = time.monotonic()
try:
    mngr.save(STEP, args=oeqx.EqxSave(tree))
    mngr.wait_until_finished()
    outcome = {"ok": True}
except Exception as e:  # recorded for the test to judge
    outcome = {"ok": False, "type": type(e).__name__, "message": str(e)}
    outcome["traceback"] = traceback.format_exc()[-3000:]
outcome["seconds"] = time.monotonic() - began
outcome["done_at"] = time.time()
try:
    mngr.close()
except Exception as e:
    outcome.setdefault("close", f"{type(e).__name__}: {e}")
# Written whole, then renamed: the test reads it as soon as the name appears.
written = ROOT.parent / f"outcome-{WHO}.json.part"
written.write_text(json.dumps(outcome))
os.replace(written, ROOT.parent / f"outcome-{WHO}.json")
print("done", json.dumps({k: v for k, v in outcome.items() if k != "traceback"}))
sys.stdout.flush()
# If this process then fails to exit, the test will want to see where.
faulthandler.dump_traceback_later(int(args.timeout_s) + 15, exit=True)
