"""Overwrites one standalone checkpoint again and again until it is killed.

Usage: python _replace_crash_worker.py PATH SWAP

Once started up it prints `ready` and reads the first version to save from
stdin (so a test can start the next worker while it checks the last one).
Version `v` saves `replace_item(v)` with `oeqx.save(PATH, ..., overwrite=True)`,
so whoever restores PATH knows exactly which values it must hold. Prints
`saving V` before each save, and rests `REST` seconds after it. SWAP is
`exchange` (the kernel exchanges the two names in one call) or `renames` (the
two renames used where it cannot: this worker runs as on such a system).
"""

import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

import orbax_eqx as oeqx
from orbax_eqx._save import replace

# After each save, about as long as a save takes here (20-50 ms): a kill then
# falls after a finished swap about as often as inside a save, so that the
# test sees both outcomes in its rounds (without the rest, the window after a
# swap was a few ms of each save, and one CI run under load saw no kill in it
# in 24 rounds).
REST = 0.03


def replace_item(version: int) -> dict:
    """About 1.5 MiB in 12 arrays of three kinds, plus Python leaves; every
    version different. Odd versions keep their jax arrays in Orbax's store,
    so a swap replaces a checkpoint of the other layout, with more files."""
    rng = np.random.default_rng(version)
    return {
        "layers": [
            jnp.asarray(rng.standard_normal((128, 256), np.float32)) for _ in range(10)
        ],
        "table": np.arange(4096, dtype=np.int64) * (version + 1),
        "half": jnp.full((300,), version, jnp.bfloat16),
        "version": version,
        "tag": f"version-{version}",
    }


def main() -> None:
    path, swap = sys.argv[1], sys.argv[2]
    if swap == "renames":
        replace._renameat2 = lambda: None  # as where renameat2 is missing
    # The first save of a process is slow (JAX and Orbax start up): done
    # elsewhere, so that the kills fall on saves as they usually run.
    with tempfile.TemporaryDirectory() as scratch:
        for pack in (True, False):
            oeqx.save(f"{scratch}/warm", replace_item(0), overwrite=True, pack=pack)
    print("ready", flush=True)
    first = int(sys.stdin.readline())
    for version in range(first, first + 1000):
        print(f"saving {version}", flush=True)
        oeqx.save(path, replace_item(version), overwrite=True, pack=version % 2 == 0)
        time.sleep(REST)


if __name__ == "__main__":
    main()
