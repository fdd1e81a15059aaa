"""Worker for test_type_handler_sharded.py: one JAX process (of a group, with
`--processes`), saving and restoring through Orbax's own PyTreeCheckpointHandler
with `oeqx.type_handler_registry()`.

    python _type_handler_worker.py save ROOT       # 8 devices in all: P("x")
    python _type_handler_worker.py restore ROOT    # any devices, one process

`save` first checks that host-local arrays are refused before anything is
written (with several processes), then saves step 1 of a state whose arrays
are sharded P("x") over every device of every process (plus a replicated
one, typed PRNG keys, a zero-size array) and checks which process wrote
which file. With 8 devices in one process it also restores onto a (2, 4)
mesh cut across the saved shards. `restore` restores step 1 in one process
onto a mesh of its devices and onto one device, and checks that a restore
without shardings says the saved ones cannot be rebuilt. `fail` restores
step 1 on every process onto the saving mesh, expecting an error (the test
damaged what only one process reads), and prints `ERROR {json}` with it.
Prints `ok` last.
"""

import json
import re
import sys
from pathlib import Path

from _worker import start

args = start("mode", "root")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

ROOT = Path(args.root)
PROCESS = jax.process_index()
LAYERS = 24  # sharded float32 leaves, besides the odd ones


def values() -> dict[str, np.ndarray]:
    """Every array's full value, the same in every process (numpy's generator)."""
    rng = np.random.default_rng(7)
    out = {
        f"layers.{i}.w": rng.standard_normal((64, 16), np.float32)
        for i in range(LAYERS)
    }
    out["embed"] = rng.standard_normal((16, 40)).astype(jnp.bfloat16)
    out["counts"] = rng.integers(0, 2**31, (48,), dtype=np.int32)
    out["keys"] = rng.integers(0, 2**32, (8, 2), dtype=np.uint32)  # key data
    out["scale"] = rng.standard_normal((8,), np.float32)  # replicated
    out["empty"] = np.zeros((0, 8), np.float32)
    return out


SPECS = {"embed": P(None, "x"), "scale": P(), "empty": P("x")}
# On a ("a", "b") mesh of 2 x 4: boundaries that cut across the saved chunks.
SPECS_2D = {
    "embed": P("a", "b"),
    "scale": P("b"),
    "empty": P(),
    "counts": P(("b", "a")),
    "keys": P("b"),
}


def place(value: np.ndarray, name: str, sharding) -> jax.Array:
    if name == "keys":
        data = jax.make_array_from_callback(
            value.shape, _data_sharding(sharding), lambda i: value[i]
        )
        return jax.random.wrap_key_data(data, impl="threefry2x32")
    return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])


def _data_sharding(sharding):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*sharding.spec, None))
    return sharding


def state(mesh, specs, default) -> dict:
    tree = {
        name: place(v, name, NamedSharding(mesh, specs.get(name, default)))
        for name, v in values().items()
    }
    tree["step"] = 1
    return tree


def target(shardings) -> dict:
    """Abstract arrays on `shardings(name)`, built without the saved values."""
    out = {}
    for name, v in values().items():
        dtype = jax.random.key(0).dtype if name == "keys" else v.dtype
        shape = v.shape[:-1] if name == "keys" else v.shape
        out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=shardings(name))
    out["step"] = 0
    return out


def check(restored, shardings) -> None:
    want = values()
    assert restored["step"] == 1
    for name, v in want.items():
        x = restored[name]
        assert x.sharding == shardings(name), (name, x.sharding, shardings(name))
        if name == "keys":
            assert jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key), x.dtype
        for shard in x.addressable_shards:
            data = jax.random.key_data(shard.data) if name == "keys" else shard.data
            np.testing.assert_array_equal(
                np.asarray(data), v[shard.index], err_msg=name, strict=True
            )
    print(f"equal: {len(want)} arrays, on {shardings('layers.0.w')}", flush=True)


def manager():
    handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=oeqx.type_handler_registry()
    )
    return ocp.CheckpointManager(ROOT, item_handlers=handler)


def refuse_host_local(mesh) -> None:
    bad = {"global": place(values()["scale"], "scale", NamedSharding(mesh, P()))}
    bad["local"] = jnp.ones(3)  # on this process's devices alone
    mngr = manager()
    try:
        mngr.save(0, args=ocp.args.PyTreeSave(bad))
        mngr.wait_until_finished()
    except oeqx.UnsupportedLeafError as e:
        device = bad["local"].sharding.device_set.pop().id
        expected = (
            "Cannot save: this save runs on 2 processes, and a multi-host "
            "checkpoint holds only global arrays.\n"
            f"  - Leaf `local` is a host-local jax.Array (shape (3,), on "
            f"device {device} of process {PROCESS} only).\n"
            "Make each a global array before saving"
        )
        assert str(e).startswith(expected), str(e)
        assert "global" not in str(e).split("\n")[1], str(e)
    else:
        raise AssertionError("a host-local array was saved")
    mngr.close()
    assert not list(ROOT.rglob("orbax_eqx~typed.*")), list(ROOT.rglob("*"))


def save() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    if jax.process_count() > 1:
        refuse_host_local(mesh)
    item = state(mesh, SPECS, P("x"))
    assert not item["layers.0.w"].is_fully_addressable or jax.process_count() == 1
    mngr = manager()
    assert mngr.save(1, args=ocp.args.PyTreeSave(item))
    mngr.wait_until_finished()
    mngr.close()
    (group,) = (ROOT / "1" / "default").glob("orbax_eqx~typed.*")
    files = sorted(p.name for p in group.iterdir())
    token = group.name.split(".")[-1]
    expected = [f"orbax_eqx~packed.{token}.0.bin"]  # the replicated leaf
    for p in range(jax.process_count()):  # each process's own shards
        expected += [f"orbax_eqx~shards.{token}.{p}.bin"]
        expected += [f"orbax_eqx~shards.{token}.{p}.json"]
    assert files == sorted(expected + ["orbax_eqx.json"]), files
    print("files:", files, flush=True)
    if jax.process_count() > 1:
        return
    # Onto another mesh, in the same process: boundaries cut across chunks.
    mesh2 = jax.make_mesh((2, 4), ("a", "b"))

    def on_2d(name):
        return NamedSharding(mesh2, SPECS_2D.get(name, P("b", "a")))

    mngr = manager()
    abstract = target(on_2d)
    restored = mngr.restore(
        1,
        args=ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
        ),
    )
    check(restored, on_2d)
    mngr.close()


def restore() -> None:
    assert jax.process_count() == 1
    mngr = manager()
    mesh = jax.make_mesh((jax.device_count(),), ("x",))

    def on_mesh(name):
        specs = {"embed": P("x"), "scale": P(), "empty": P(), "keys": P("x")}
        spec = specs.get(name, P("x") if name == "counts" else P(None, "x"))
        return NamedSharding(mesh, spec)

    def on_one(name):
        return SingleDeviceSharding(jax.devices()[-1])

    for shardings in (on_mesh, on_one):
        abstract = target(shardings)
        restored = mngr.restore(
            1,
            args=ocp.args.PyTreeRestore(
                abstract,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            ),
        )
        check(restored, shardings)
    # No shardings given: the saved ones name devices this process lacks.
    try:
        mngr.restore(1)
    except oeqx.CheckpointMismatchError as e:
        print(e, flush=True)
        assert re.search(
            r"  - Leaf `counts` has no target sharding: none was given, and "
            r"the saved one \(P\('x'\) over x=8\) cannot be rebuilt on this "
            rf"process's {jax.device_count()} device\(s\)\.\n",
            str(e),
        ), str(e)
        assert str(e).endswith(
            "Give each jax array a sharding of this process's devices: "
            "`ArrayRestoreArgs(sharding=...)`, or a target leaf with one "
            "(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`)."
        ), str(e)
    else:
        raise AssertionError("restored onto devices this process lacks")
    mngr.close()


def fail() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("x",))

    def as_saved(name):
        return NamedSharding(mesh, SPECS.get(name, P("x")))

    mngr = manager()
    abstract = target(as_saved)
    try:
        mngr.restore(
            1,
            args=ocp.args.PyTreeRestore(
                abstract,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            ),
        )
    except Exception as e:
        print("ERROR " + json.dumps([type(e).__name__, str(e)]), flush=True)
    else:
        raise AssertionError("the restore did not fail")
    mngr.close()


MODES = {"save": save, "restore": restore, "fail": fail}

if __name__ == "__main__":
    MODES[args.mode]()
    print("ok", flush=True)
    sys.exit(0)
