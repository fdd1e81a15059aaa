"""The packed layout, written: which leaves go in the pack, and the pack file
written with each piece's checksum (see `_storage/ranges.py` for where each
leaf goes and how the file is written)."""

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from ..._format.checksum import CRC32, data_sum
from ..._tree.walk import JAX, container
from .. import ranges as _ranges


def packable(x: Any) -> bool:
    """Whether an array leaf goes in the pack: every copy of it is the whole array."""
    if container(x) != JAX:
        return True
    return isinstance(x, jax.Array) and x.is_fully_replicated


def write(
    path: epath.Path,
    pieces: Sequence[tuple[int, np.ndarray]],
    nbytes: int,
    checksums: bool = True,
    algorithm: str = CRC32,
) -> list[int]:
    """Writes pack file `path` (see `_ranges.write`); returns each piece's
    checksum `algorithm` (see `checksum.Running`; none without `checksums`).

    The checksums are computed in a second thread while the file is written:
    both release the GIL, so on two cores they cost about the time of the
    slower one.
    """
    if not checksums:
        _ranges.write(path, pieces, nbytes)
        return []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        crcs = pool.submit(lambda: [data_sum(x, algorithm) for _, x in pieces])
        _ranges.write(path, pieces, nbytes)
        return crcs.result()
