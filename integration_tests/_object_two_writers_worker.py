"""One of two jobs saving step 5 of one run on an object store at once.

    python _object_two_writers_worker.py ROOT WHO

Builds an item of writer WHO's values, writes `ready-WHO`, waits for the
test's `go` file, saves step 5 through its own CheckpointManager in Orbax's
commit-file mode, and writes `outcome-WHO.json`: {"ok": true} or the error.
The store's environment comes from the test.
"""

import json
import pathlib
import sys
import time
import traceback

from _worker import start

args = start("root", "who")

import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

WHO = int(args.who)
item = {"w": jnp.full((1 << 18,), float(WHO))}
options = ocp.CheckpointManagerOptions(
    temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath,
    async_options=ocp.AsyncOptions(timeout_secs=60),
)
pathlib.Path(f"ready-{WHO}").touch()
waited = time.monotonic()
while not pathlib.Path("go").exists():
    if time.monotonic() - waited > 120:
        sys.exit("no go from the test within 120 s")
    time.sleep(0.005)
time.sleep(max(0.0, float(pathlib.Path("go").read_text()) - time.time()))
try:
    with ocp.CheckpointManager(
        args.root, item_handlers=oeqx.EqxHandler(), options=options
    ) as mngr:
        mngr.save(5, args=oeqx.EqxSave(item))
        mngr.wait_until_finished()
    outcome = {"ok": True}
except Exception as e:  # judged by the test
    outcome = {
        "ok": False,
        "type": type(e).__name__,
        "message": str(e),
        "traceback": traceback.format_exc(),
    }
pathlib.Path(f"outcome-{WHO}.json").write_text(json.dumps(outcome))
print("ok", flush=True)
