"""The shard-pack read's copy window, A/B, where it binds.

    python benchmarks/reshard_window.py [GIB] [ROUNDS]   # default 3 GiB, 2 rounds

Saves GIB of float32 arrays sharded `P("fsdp")` over 8 CPU devices, then
restores them onto a (4, 2) mesh `P("x", "y")`, so that every restored shard
is assembled from copies of two saved chunks, with the read's `COPY_WINDOW`
(bytes read only to be copied, per batch) at 64 MiB and at 256 MiB in turns.
The window is capped at an eighth of what the process holds, so it binds
only for models over 512 MiB (8 x 64 MiB): `sharded.py`'s (a), 509 MiB,
cannot tell the two apart. Prints each restore's time and the best of each
window, with the configuration. A measurement, never a test.
"""

import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_eqx as oeqx
from orbax_eqx._storage.sharded import read as shard_read

WINDOWS = (64, 256)  # MiB
ARRAYS = 24
COLUMNS = 4096


def main(gib: float, rounds: int) -> None:
    devices = np.array(jax.devices())
    saving = Mesh(devices, ("fsdp",))
    other = Mesh(devices.reshape(4, 2), ("x", "y"))
    rows = int(gib * 2**30 / ARRAYS / 4 / COLUMNS) // 8 * 8
    rng = np.random.default_rng(0)
    tree = {
        f"w{i}": jax.device_put(
            rng.standard_normal((rows, COLUMNS), np.float32),
            NamedSharding(saving, P("fsdp")),
        )
        for i in range(ARRAYS)
    }
    total = sum(x.nbytes for x in tree.values())
    print(
        f"{os.cpu_count()} CPUs, {len(devices)} CPU devices, {ARRAYS} arrays, "
        f"{total / 2**30:.2f} GiB, jax {jax.__version__}, page cache warm",
        flush=True,
    )
    workdir = tempfile.mkdtemp()
    path = os.path.join(workdir, "ckpt")
    start = time.perf_counter()
    oeqx.save(path, tree)
    print(f"save {time.perf_counter() - start:.2f} s", flush=True)
    target = NamedSharding(other, P("x", "y"))
    skeleton = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=target)
        for k, v in tree.items()
    }
    del tree
    times: dict[int, list[float]] = {w: [] for w in WINDOWS}
    for r in range(rounds):
        for window in WINDOWS if r % 2 == 0 else WINDOWS[::-1]:
            shard_read.COPY_WINDOW = window << 20
            start = time.perf_counter()
            out = jax.block_until_ready(oeqx.restore(path, skeleton))
            took = time.perf_counter() - start
            times[window].append(took)
            print(
                f"round {r} window {window} MiB: restore onto the (4, 2) mesh "
                f"{took:.2f} s ({total / took / 2**30:.2f} GiB/s)",
                flush=True,
            )
            del out
    for window, taken in times.items():
        rounded = [round(t, 2) for t in taken]
        print(f"window {window} MiB: best {min(taken):.2f} s, all {rounded}")
    shutil.rmtree(workdir)


if __name__ == "__main__":
    main(
        float(sys.argv[1]) if len(sys.argv) > 1 else 3.0,
        int(sys.argv[2]) if len(sys.argv) > 2 else 2,
    )
