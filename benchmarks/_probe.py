"""Peak host memory of one restore, in a fresh process.

Usage (by `run.py`): `python _probe.py CONTENDER MODEL PATH`. Prints one JSON
line: the resident set size before the restore (imports, JAX, the skeleton),
its peak during the restore, and the restore's wall time. The peak is reset
just before the restore (`/proc/self/clear_refs`), so it is the restore's own.
"""

import json
import sys
import time

import _contenders
import _models
import jax
import numpy as np


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(contender: str, model: str, path: str) -> None:
    skeleton = _models.skeleton(model)
    runner = {**_contenders.CONTENDERS, **_contenders.EXTRA}[contender]()
    jax.block_until_ready(jax.device_put(np.zeros(4)))  # start the backend
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    restored = jax.block_until_ready(runner.restore(path, skeleton))
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    after = _status("VmRSS")
    del restored
    print(
        json.dumps(
            {"baseline": baseline, "peak": peak, "after": after, "seconds": seconds}
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
