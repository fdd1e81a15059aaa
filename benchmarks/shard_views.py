"""What holding a CPU shard against donation costs, by every public way.

    python benchmarks/shard_views.py [--arrays 5400] [--devices 8] [--rounds 5]

`save()` on 8 CPU devices returns once it holds every shard it writes: numpy's
view of each shard's buffer (`np.asarray(x.addressable_data(i))`), which
keeps a later donation of the array from reusing the bytes. Issue 30's
target, 8 devices <= 2x 1 device for the 6,313-leaf model, is missed by what
that costs per shard in JAX. This script times, on `--arrays` arrays of
(64, 16) float32 sharded `P("fsdp")` over `--devices` CPU devices (one
process, forced host devices), medians of `--rounds`, each way on arrays
just made (as a save after a training step sees them: JAX caches a shard's
numpy value and an array's shard list on the objects, so a second pass over
the same arrays costs less than the save pays):

- the save's own step (`orbax_eqx._storage.sharded.write.start_take`, the
  views and their boxes);
- `x.addressable_data(i)` alone (a shard's array, no bytes held: it is
  deleted with its parent when that is donated);
- the public ways to hold a shard's bytes: `np.asarray` of it (what the save
  does), `np.from_dlpack` of it, and `np.asarray(shard.data)` over
  `x.addressable_shards`.

Rerun it on a newer JAX: the day one of these costs much less per shard than
`np.asarray`, the save should use it. Prints the configuration; never a test.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(arrays: int, devices: int, rounds: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    sys.path.insert(0, str(HERE.parent))
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from orbax_eqx._storage.sharded import write as _write

    mesh = jax.make_mesh((devices,), ("fsdp",))
    sharding = NamedSharding(mesh, P("fsdp"))
    hosts = [np.full((8 * devices, 16), i, np.float32) for i in range(arrays)]
    names = [f"a{i}" for i in range(arrays)]
    shards = arrays * devices
    print(
        f"{arrays} arrays of ({8 * devices}, 16) float32, P('fsdp') over "
        f"{devices} {jax.default_backend()} devices ({shards} shards), one "
        f"process; medians of {rounds}; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}; Python {platform.python_version()}, jax "
        f"{jax.__version__}, numpy {np.__version__}"
    )
    ways = {
        # (`take`: `start_take` and its wait, the views returned and held.)
        "the save's step (start_take)": lambda xs: _write.take(
            list(zip(names, xs, strict=True))
        ),
        "addressable_data(i) alone": lambda xs: [
            x.addressable_data(i) for x in xs for i in range(devices)
        ],
        "np.asarray(addressable_data(i))": lambda xs: [
            np.asarray(x.addressable_data(i)) for x in xs for i in range(devices)
        ],
        "np.from_dlpack(addressable_data(i))": lambda xs: [
            np.from_dlpack(x.addressable_data(i)) for x in xs for i in range(devices)
        ],
        "np.asarray(shard.data), addressable_shards": lambda xs: [
            np.asarray(s.data) for x in xs for s in x.addressable_shards
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        way(jax.device_put(hosts, sharding))  # warm: the save's placement plans
    for _ in range(rounds):
        for name, way in ways.items():  # in turns, so drift falls on all
            xs = jax.block_until_ready(jax.device_put(hosts, sharding))
            start = time.perf_counter()
            held = way(xs)
            times[name].append(time.perf_counter() - start)
            del held, xs
    floor = statistics.median(times["np.asarray(addressable_data(i))"])
    for name, taken in times.items():
        median = statistics.median(taken)
        print(
            f"  {name:44s} {median * 1e3:8.1f} ms  {median / shards * 1e6:5.2f} "
            f"us a shard  {median / floor:5.2f}x np.asarray"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=5400)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    main(options.arrays, options.devices, options.rounds)
