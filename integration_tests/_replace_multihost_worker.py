"""Worker for test_replace_multihost.py: one process of a `jax.distributed`
group saving standalone checkpoints of global arrays.

    python _replace_multihost_worker.py {overwrite,primary1} BASE

Saves BASE/ckpt, overwrites it, restores it in every process; then asks to
overwrite a directory of user files, which every process must refuse alike.
`primary1` saves with `MultiprocessingOptions(primary_host=1)`: process 1
writes the sidecar, tidies, swaps the new checkpoint in and tells the others
whether it could. Prints `ok` last.
"""

import os
import sys
from pathlib import Path

from _worker import start

args = start("mode", "base")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

BASE = Path(args.base)
MESH = jax.make_mesh((jax.device_count(),), ("x",))
ROWS = NamedSharding(MESH, P("x"))
ALL = NamedSharding(MESH, P())
PRIMARY = 1 if args.mode == "primary1" else 0
OPTIONS = {}
if PRIMARY:
    OPTIONS["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
        primary_host=PRIMARY
    )


def item(version: int) -> dict:
    def global_array(sharding, value):
        return jax.make_array_from_callback(
            (8, 16), sharding, lambda index: np.full((8, 16), value, np.float32)[index]
        )

    return {
        "rows": global_array(ROWS, version),
        "replicated": global_array(ALL, version + 0.5),
        "version": version,
    }


def main() -> None:
    path = BASE / "ckpt"
    oeqx.save(path, item(1), **OPTIONS)
    oeqx.save(path, item(2), overwrite=True, **OPTIONS)
    skeleton = {
        "rows": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=ROWS),
        "replicated": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=ALL),
        "version": 0,
    }
    restored = oeqx.restore(path, skeleton)
    assert restored["version"] == 2
    for name, value in (("rows", 2.0), ("replicated", 2.5)):
        for shard in restored[name].addressable_shards:
            assert (np.asarray(shard.data) == value).all(), name
    if jax.process_index() == PRIMARY:
        assert os.listdir(BASE) == ["ckpt"], os.listdir(BASE)
    user = BASE / "user"
    if jax.process_index() == PRIMARY:  # after its look at BASE
        user.mkdir()
        (user / "notes.txt").write_text("mine")
    sync = {"w": jax.device_put(jnp.ones(2), ALL)}
    oeqx.save(BASE / "sync", sync, **OPTIONS)  # a barrier
    try:
        oeqx.save(user, item(3), overwrite=True, **OPTIONS)
    except FileExistsError:
        pass
    else:
        raise AssertionError("user files replaced")
    assert (user / "notes.txt").read_text() == "mine"


if __name__ == "__main__":
    main()
    print("ok", flush=True)
    sys.exit(0)
