"""Worker for test_object_stores.py: sharded saves and restores on gs:// or s3://.

    python _object_store_worker.py save URL      # a (4, 2) mesh over all devices
    python _object_store_worker.py restore URL   # a (2, 2) or (1,) mesh, other rules

The object store's environment (endpoint, credentials) comes from the test's
fixtures through the inherited environment. `save` writes steps 1 and 2 with
a CheckpointManager in Orbax's commit-file mode, `max_to_keep=1` and a best
metric; `restore` restores what is kept onto another mesh and process count
and checks every value. Prints `ok` last.
"""

import sys

from _worker import start

args = start("mode", "url")

import _net  # noqa: E402
import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

STEPS = (1, 2)


def manager():
    options = ocp.CheckpointManagerOptions(
        max_to_keep=1,
        best_fn=lambda m: m["loss"],
        best_mode="min",
        temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath,
    )
    return ocp.CheckpointManager(
        args.url, item_handlers=oeqx.EqxHandler(), options=options
    )


def save():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    shardings = _net.rules(mesh, _net.SAVE_RULES)
    with manager() as mngr:
        for step, loss in zip(STEPS, (0.5, 0.9), strict=True):
            item = _net.globalize(_net.saved_item(step), shardings)
            mngr.save(step, args=oeqx.EqxSave(item), metrics={"loss": loss})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1], mngr.all_steps()  # the best one kept


def restore():
    n = jax.device_count()
    mesh = jax.make_mesh((2, n // 2) if n > 1 else (1, 1), ("data", "model"))
    shardings = _net.rules(mesh, _net.RESTORE_RULES_2D)
    with manager() as mngr:
        assert mngr.all_steps() == [1] and mngr.best_step() == 1
        restored = mngr.restore(
            1, args=oeqx.EqxRestore(_net.skeleton(), shardings=shardings)
        )
        _net.check_restored(restored, _net.saved_item(1), shardings)


{"save": save, "restore": restore}[args.mode]()
print("ok", flush=True)
sys.exit(0)
