"""Which writer pays for the page cache: `oeqx.save` and a raw write, in turns.

    REPS=2 WHAT=oeqx,raw python benchmarks/write_order.py 48   # 48 x 64 MiB
    REPS=2 WHAT=raw,oeqx python benchmarks/write_order.py 48

One process (CPU, 1 device) makes N float32 jax arrays of 64 MiB, then saves
them with `oeqx.save` (checksums on) and writes the same bytes with one
`pwritev` per array + fsync (the raw floor of `benchmarks/cold_io.py`), in
the order `WHAT` gives, `REPS` times, deleting each output at once. It
prints wall and CPU time of each. Written to find why `cold_io.py`'s saves
swing: on this VM the first 3 GiB written in a process costs several times
the later ones, whichever writer it is.
"""

import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import orbax_eqx as oeqx


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    rng = np.random.default_rng(0)
    arrays = {
        f"a{i}": jnp.asarray(rng.random((16 << 20,), dtype=np.float32))
        for i in range(n)
    }
    jax.block_until_ready(arrays)
    where = os.environ.get("DIR", ".")

    def raw(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        offset = 0
        for a in arrays.values():
            offset += os.pwritev(fd, [memoryview(np.asarray(a)).cast("B")], offset)
        os.fsync(fd)
        os.close(fd)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, 1 device")
    for rep in range(int(os.environ.get("REPS", "2"))):
        for what in os.environ.get("WHAT", "oeqx,raw").split(","):
            path = os.path.join(where, f"write-order-{what}{rep}")
            start, cpu = time.perf_counter(), time.process_time()
            oeqx.save(path, arrays) if what == "oeqx" else raw(path)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            print(
                f"{what} {n * 64} MiB: {wall:.2f} s wall, {cpu:.2f} s cpu", flush=True
            )
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


if __name__ == "__main__":
    main()
