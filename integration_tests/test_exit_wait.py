"""A process whose save failed exits promptly: our threads do not hold it.

What Orbax waits for: every commit future's thread first waits for the save's
"directory made" signals (a CheckpointManager makes the step's directory, then
each item's, in the background), for up to its coordination timeout, 300 s;
those threads are not daemons, so the interpreter cannot exit while they
wait. When Orbax fails to make a directory the signals never come. Here an
item name too long for the file system makes Orbax fail to make the item's
directory, after the step's: then only our handler's threads wait (its own
writes, and the inner Orbax handler's for arrays in Orbax's store), and the
process must exit within seconds. See `_save/released.py`.

When the step's directory itself cannot be made, Orbax's own thread for the
item directories waits too, and holds the process for the 300 s whatever we
do: there, ours are only checked to be daemons, and the process is ended
without waiting.
"""

import subprocess
import sys
import textwrap
import time

import pytest

from . import _procs

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    import jax, jax.numpy as jnp, orbax.checkpoint as ocp, orbax_eqx as oeqx
    from jax.sharding import NamedSharding, PartitionSpec as P

    root, where, arrays = sys.argv[1:4]
    item = {"w": jnp.ones((8, 8)), "step": 3}
    if arrays == "sharded":  # kept in Orbax's store: the inner handler's threads
        mesh = jax.make_mesh((2,), ("x",))
        item["s"] = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("x")))
    long = "n" * 250  # longer than a file name may be, with Orbax's suffix
    if where == "item":
        mngr = ocp.CheckpointManager(root, item_handlers={long: oeqx.EqxHandler()})
        args = ocp.args.Composite(**{long: oeqx.EqxSave(item)})
    else:
        options = ocp.CheckpointManagerOptions(step_prefix=long)
        mngr = ocp.CheckpointManager(
            root, item_handlers=oeqx.EqxHandler(), options=options
        )
        args = oeqx.EqxSave(item)
    try:
        mngr.save(0, args=args)
        mngr.wait_until_finished()
    except OSError as e:
        print("SAVE FAILED:", e, flush=True)
    mngr.close()
    holding = sorted(t.name for t in threading.enumerate()
                     if not t.daemon and t is not threading.main_thread())
    print("HOLDING:", holding, flush=True)
    if where == "step":
        os._exit(0)  # Orbax's own thread would hold the process for 300 s
    """
)
EXIT_S = 60  # plenty on a loaded machine; the wait this is about is 300 s


def _run(tmp_path, where, arrays):
    devices = 2 if arrays == "sharded" else 1
    start = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path / "root"), where, arrays],
            capture_output=True,
            text=True,
            timeout=EXIT_S,
            env=_procs.worker_env(devices),
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""  # killed (SIGKILL) by `subprocess.run`
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        pytest.fail(f"still running after {EXIT_S} s:\n{out[-3000:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SAVE FAILED: [Errno 36] File name too long" in result.stdout, (
        result.stdout + result.stderr[-3000:]
    )
    return result.stdout, time.monotonic() - start


@pytest.mark.parametrize("arrays", ["packed", "sharded"])
def test_a_failed_save_does_not_hold_the_process_at_exit(tmp_path, arrays):
    out, seconds = _run(tmp_path, "item", arrays)
    assert "HOLDING: []" in out, out
    print(f"exited {seconds:.1f} s after starting")


def test_our_threads_never_hold_the_process_where_orbax_s_do(tmp_path):
    out, _ = _run(tmp_path, "step", "sharded")
    holding = out.split("HOLDING:")[1].splitlines()[0]
    # Ours, and those the inner Orbax handler starts for our save.
    names = ("orbax_eqx", "serialize_shardings", "array_type_handler", "write_meta")
    assert not any(name in holding for name in names), holding
