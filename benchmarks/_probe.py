"""Peak host memory of one restore, in a fresh process.

Usage (by `run.py`): `python _probe.py CONTENDER MODEL PATH`. Prints one JSON
line: the resident set size before the restore (imports, JAX, the skeleton),
its peak during the restore, and the restore's wall time. The peak is reset
just before the restore (`/proc/self/clear_refs`), so it is the restore's own.
One function is compiled before the baseline: the first compilation in a
process costs ~40 MiB of RSS (XLA's compiler starting), which a training job
pays anyway, and which would otherwise count against whichever restore
compiles first. Where the backend keeps device memory figures (not on CPU),
also the devices' peak bytes in use during the restore, above the baseline
(`device_peak`; None elsewhere).
"""

import json
import sys
import time

import _contenders
import _models
import jax
import numpy as np
from _proc import status as _status


def main(contender: str, model: str, path: str) -> None:
    skeleton = _models.skeleton(model)
    runner = {**_contenders.CONTENDERS, **_contenders.EXTRA}[contender]()
    jax.block_until_ready(jax.device_put(np.zeros(4)))  # start the backend
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(4)))  # the compiler
    device_before = _device_memory()
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    restored = jax.block_until_ready(runner.restore(path, skeleton))
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    after = _status("VmRSS")
    device_after = _device_memory()
    device_peak = None
    if device_before is not None:
        device_peak = device_after[1] - device_before[0]
    del restored
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak": peak,
                "after": after,
                "seconds": seconds,
                "device_peak": device_peak,
            }
        )
    )


def _device_memory():
    """`(bytes in use, peak bytes in use)` over local devices, or None (CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if not all(stats) or not all("peak_bytes_in_use" in s for s in stats):
        return None
    return (
        sum(s["bytes_in_use"] for s in stats),
        sum(s["peak_bytes_in_use"] for s in stats),
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
