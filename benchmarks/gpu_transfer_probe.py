"""What a device-to-host transfer costs the calling thread, on an accelerator.

    python benchmarks/gpu_transfer_probe.py

For 99 fresh float32 arrays of 5 MiB (0.5 GiB, model (a)'s size), three
repeats of: `jax.device_get` of them; a device-side copy
(`jax.device_put(..., may_alias=False)`) and then `copy_to_host_async()` on
each copy, timing when each step returns; and `x.copy()` (a device-side copy
through a computation). A save may return once the arrays are safe from
donation: this says how long each way keeps the caller. On CPU devices
every step is a view or a memcpy, so the figures only mean something on an
accelerator.
"""

import time

import jax
import numpy as np

SHAPES = [(1024, 1280)] * 99  # 0.5 GiB of float32


def fresh(key) -> list[jax.Array]:
    xs = [
        jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate(SHAPES)
    ]
    return jax.block_until_ready(xs)


def main() -> None:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    print(f"jax {jax.__version__}, {device.device_kind} ({device.platform});")
    print(
        f"memory: limit {stats.get('bytes_limit')}, in use {stats.get('bytes_in_use')}"
    )
    key = jax.random.key(0)
    for rep in range(3):
        xs = fresh(key)
        t = time.perf_counter()
        jax.device_get(xs)
        got = time.perf_counter() - t

        xs = fresh(key)
        t = time.perf_counter()
        copies = jax.device_put(xs, [x.sharding for x in xs], may_alias=False)
        put = time.perf_counter() - t
        for c in copies:
            c.copy_to_host_async()
        started = time.perf_counter() - t
        jax.block_until_ready(copies)
        ready = time.perf_counter() - t
        [np.asarray(c) for c in copies]
        on_host = time.perf_counter() - t

        xs = fresh(key)
        t = time.perf_counter()
        computed = [x.copy() for x in xs]
        dispatched = time.perf_counter() - t
        jax.block_until_ready(computed)
        done = time.perf_counter() - t
        print(
            f"rep{rep}: device_get {got:.3f} s | device_put(may_alias=False) "
            f"returns {put:.3f}, copy_to_host_async calls done {started:.3f}, "
            f"copies ready {ready:.3f}, host arrays {on_host:.3f} | x.copy() "
            f"returns {dispatched:.3f}, ready {done:.3f}"
        )


if __name__ == "__main__":
    main()
