"""Worker for test_multihost.py: one JAX process of a `jax.distributed` group.

    python _multihost_worker.py save ROOT        # 8 devices in all: a (4, 2) mesh
    python _multihost_worker.py restore ROOT     # 4 devices in all: a (2, 2) mesh
    python _multihost_worker.py host-local ROOT

`_procs.run` appends `--process-id`, `--processes` and `--port`.

`save` writes steps 1 and 2 through a CheckpointManager with EqxHandler, the
model sharded by `_net.SAVE_RULES` over every process's devices. Every process
records, in ROOT/../hosts/, the sidecar content its handler computed
(`computed-<step>-p<process>.json`) and each sidecar file it actually wrote
(`writes-p<process>.txt`); process 0 writes ROOT/../fingerprints.json. Prints
`ok` last.
"""

import json
import sys
from pathlib import Path

from _worker import start

args = start("mode", "root")

import _net  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from orbax_eqx._format import sidecar_write as _sidecar_write  # noqa: E402
from orbax_eqx._save import files as _files  # noqa: E402

ROOT = Path(args.root)
HOSTS = ROOT.parent / "hosts"
FINGERPRINTS = ROOT.parent / "fingerprints.json"
STEPS = (1, 2)
PROCESS = jax.process_index()


def record_sidecars():
    """Records what every host's handler computes for the sidecar, and which
    hosts write it. (Private hooks: this is the one place to see both.)"""
    HOSTS.mkdir(exist_ok=True)
    compute = _files.write
    write = _sidecar_write.write

    def computed(directory, prepared, *rest):
        # Before the primary adds the checksums, which only it computes.
        step = Path(directory).parent.name.split(".")[0]
        path = HOSTS / f"computed-{step}-p{PROCESS}.json"
        prepared.finish()  # names the leaves and builds the content
        path.write_text(json.dumps(prepared.content, sort_keys=True))
        compute(directory, prepared, *rest)

    def written(directory, content, *rest):
        write(directory, content, *rest)
        with open(HOSTS / f"writes-p{PROCESS}.txt", "a") as f:
            f.write(f"{Path(directory).parent.name.split('.')[0]}\n")

    _files.write = computed
    _sidecar_write.write = written


def manager():
    return ocp.CheckpointManager(ROOT, item_handlers=oeqx.EqxHandler())


def expected(step):
    item = _net.saved_item(step)
    saved = json.loads(FINGERPRINTS.read_text())[str(step)]
    assert _net.fingerprint(item) == saved, "expected values differ from saved ones"
    return item


def save():
    record_sidecars()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    shardings = _net.rules(mesh, _net.SAVE_RULES)
    mngr = manager()
    for step in STEPS:
        local = _net.saved_item(step)
        item = _net.globalize(local, shardings)
        leaf = item["model"].embed.weight
        assert not leaf.is_fully_addressable  # really spread over the processes
        _net.check_restored(item, local, shardings)
        assert mngr.save(step, args=oeqx.EqxSave(item))
    mngr.wait_until_finished()
    assert mngr.all_steps() == list(STEPS)
    mngr.close()
    if PROCESS == 0:
        prints = {step: _net.fingerprint(_net.saved_item(step)) for step in STEPS}
        FINGERPRINTS.write_text(json.dumps(prints))


def restore():
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    shardings = _net.rules(mesh, _net.RESTORE_RULES_2D)
    mngr = manager()
    assert mngr.all_steps() == list(STEPS)
    for step in STEPS:
        restored = mngr.restore(
            step, args=oeqx.EqxRestore(_net.skeleton(), shardings=shardings)
        )
        _net.check_restored(restored, expected(step), shardings)
    # No skeleton: every process gets whole arrays on its first local device.
    flat = mngr.restore(1)
    assert flat["step"] == 1 and flat["note"] == "scale-out"
    np.testing.assert_array_equal(
        flat["model.embed.weight"], _net.saved_item(1)["model"].embed.weight
    )
    assert flat["model.embed.weight"].sharding == SingleDeviceSharding(
        jax.local_devices()[0]
    )
    if jax.process_count() == 1:  # and onto one device, with no shardings given
        device = SingleDeviceSharding(jax.devices()[0])
        restored = mngr.restore(2, args=oeqx.EqxRestore(_net.skeleton()))
        _net.check_restored(restored, expected(2), lambda n, x: device)
    mngr.close()


def host_local():
    """Host-local leaves are refused before a single directory is made."""
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    item = _net.globalize(_net.saved_item(1), _net.rules(mesh, [(r".*", P())]))
    bad = {
        "item": item,  # global: fine
        "key": jax.random.key(0),  # made by each process alone
        "bias": jnp.ones(3),
        "empty": jnp.ones((0, 3)),  # no data, so never given to Orbax: fine
    }
    mngr = manager()
    try:
        mngr.save(0, args=oeqx.EqxSave(bad))
    except oeqx.UnsupportedLeafError as e:
        message = str(e)
        print(message, flush=True)
        assert message.startswith(
            "Cannot save: a multi-host checkpoint holds only global arrays.\n"
        )
        devices = ", ".join(str(d.id) for d in jax.local_devices())
        assert (
            f"  - Leaf `bias` is a host-local jax.Array (shape (3,), on device "
            f"{devices} of process {PROCESS} only), but this save runs on 2 "
            "processes.\n" in message
        ), message
        assert "  - Leaf `key` is a host-local jax.Array (shape ()" in message
        assert "empty" not in message and "item" not in message
        assert "jax.make_array_from_process_local_data(" in message
    else:
        raise AssertionError("a host-local array was saved")
    mngr.wait_until_finished()
    mngr.close()
    assert not ROOT.exists() or not list(ROOT.iterdir()), list(ROOT.iterdir())
    standalone = ROOT.parent / f"standalone-p{PROCESS}"
    try:
        oeqx.save(standalone, bad)
    except oeqx.UnsupportedLeafError:
        pass
    else:
        raise AssertionError("a host-local array was saved")
    assert not standalone.exists()

    # Made global, the same leaves save and restore.
    replicated = NamedSharding(mesh, P())
    good = {
        k: jax.make_array_from_process_local_data(replicated, v) if k != "item" else v
        for k, v in bad.items()
    }
    mngr = manager()
    mngr.save(0, args=oeqx.EqxSave(good))
    mngr.wait_until_finished()
    restored = mngr.restore(
        0,
        args=oeqx.EqxRestore(eqx.filter_eval_shape(lambda: good), shardings=replicated),
    )
    _net.check_restored(restored["item"], _net.saved_item(1))
    for name in ("bias", "key"):  # replicated: every shard holds the whole
        shard = restored[name].addressable_shards[0].data
        np.testing.assert_array_equal(
            jax.random.key_data(shard) if name == "key" else shard,
            jax.random.key_data(bad[name]) if name == "key" else bad[name],
        )
    mngr.close()


MODES = {"save": save, "restore": restore, "host-local": host_local}

if __name__ == "__main__":
    MODES[args.mode]()
    print("ok", flush=True)
    sys.exit(0)
