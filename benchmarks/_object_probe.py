"""Peak host memory of one object-store save or restore, in a fresh process.

Usage (by `object_store.py`): `python _object_probe.py save|restore MODEL URL`,
with the store's environment set. Prints one JSON line: the model's bytes,
the resident set size before the operation (JAX, the model or skeleton) and
its peak during it (`/proc/self/clear_refs` resets the peak just before).
"""

import json
import sys
import time

import _models
import jax
import numpy as np
from _probe import _status

import orbax_eqx as oeqx


def main(mode: str, model: str, url: str) -> None:
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(4)))  # the compiler
    item = _models.build(model) if mode == "save" else None
    skeleton = _models.skeleton(model)
    nbytes = sum(
        int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves(skeleton)
        if isinstance(x, jax.ShapeDtypeStruct)
    )
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    if mode == "save":
        oeqx.save(url, item)
    else:
        jax.block_until_ready(oeqx.restore(url, skeleton))
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "model_bytes": nbytes,
                "baseline": baseline,
                "peak": _status("VmHWM"),
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
