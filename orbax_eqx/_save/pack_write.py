"""A save's pack file, written in a thread of its own while its leaves are named.

The pack's layout depends on the packed arrays' sizes in order alone
(`Prepared.take_pieces`), not on the leaves' names; and writing it is mostly
time the GIL is free (`pwritev`, the fsync, checksums of large pieces). So a
save starts it before naming the leaves and building the sidecar
(`Prepared.finish`, Python all the way), and the two overlap: at 50,000 small
leaves the pack's write and fsync took 0.5-0.6 s of a 2.8 s save. The sidecar
is still written last, once the pack is durable: it records the pack's
checksums, and a step without it is no checkpoint.
"""

import threading
from collections.abc import Callable

import numpy as np
from etils import epath

from .._format import sidecar as _sidecar
from .._storage.packed import write as _packed
from .prepare import Prepared


class PackWrite:
    """The write of pack 0 of a save, under way in a thread of its own.

    Whoever starts one calls `result()` (or `wait()`, on the way out of a
    failed save) before the save ends: no write of a save goes on after it.
    """

    def __init__(
        self,
        path: epath.Path,
        take: Callable[[], list[tuple[int, np.ndarray]]],
        nbytes: int,
        checksums: bool,
    ):
        self.path = path
        self._sums: list[int] = []
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._sums = _packed.write(path, take(), nbytes, checksums)
            except BaseException as e:  # raised by `result()`, in the save's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="orbax_eqx_pack", daemon=True)
        self._thread.start()

    def result(self) -> list[int]:
        """Waits for the write; returns each piece's checksum (none without
        checksums), or raises what the write raised."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._sums

    def wait(self) -> None:
        """Waits for the write, whatever its outcome (a save failing anyway)."""
        self._thread.join()


def start(
    directory: epath.Path, token: str, prepared: Prepared, checksums: bool
) -> PackWrite | None:
    """A `PackWrite` of `prepared`'s pack (saved with `token`), or None if this
    process writes none (no packed arrays, or not the primary host: no host
    copies taken)."""
    if not (prepared.writes_pack and prepared.pack_nbytes):
        return None
    path = directory / _sidecar.pack_file(token, 0)
    return PackWrite(path, prepared.take_pieces, prepared.pack_nbytes, checksums)
