"""The packed layout, written: which leaves go in the pack, and the pack file
written with each piece's checksum (see `_storage/ranges.py` for where each
leaf goes and how the file is written)."""

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from ..._format.checksum import xxh3
from ..._tree.walk import JAX, container
from .. import ranges as _ranges


def packable(x: Any) -> bool:
    """Whether an array leaf goes in the pack: every copy of it is the whole array."""
    if container(x) != JAX:
        return True
    return isinstance(x, jax.Array) and x.is_fully_replicated


# Pieces at least this large are summed in a second thread, while the file is
# written; smaller ones in this thread, before (a thread's turn costs more
# than summing a small array: 0.3 us for 100 bytes).
IN_THREAD = 1 << 16


def write(
    path: epath.Path,
    pieces: Sequence[tuple[int, np.ndarray]],
    nbytes: int,
    checksums: bool = True,
    known: Sequence[int | None] = (),
) -> list[int]:
    """Writes pack file `path` (see `_ranges.write`); returns each piece's
    XXH3-64 (none without `checksums`): those `known` (by piece, None where
    not) are not computed again."""
    views = [(offset, _ranges.as_bytes(x)) for offset, x in pieces]
    if not checksums:
        _ranges.write(path, views, nbytes)
        return []
    known = list(known) or [None] * len(views)
    large = [
        i
        for i, (_, view) in enumerate(views)
        if view.nbytes >= IN_THREAD and known[i] is None
    ]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        later = pool.submit(lambda: [xxh3(views[i][1]) for i in large])
        sums = [  # (0 for a large piece until its sum is in)
            k if k is not None else 0 if view.nbytes >= IN_THREAD else xxh3(view)
            for (_, view), k in zip(views, known, strict=True)
        ]
        _ranges.write(path, views, nbytes)
        for i, found in zip(large, later.result(), strict=True):
            sums[i] = found
    return sums
