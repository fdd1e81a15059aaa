"""A save's own files, written in its background thread: the shard packs, the
pack (in a thread of its own while the leaves are named), and the sidecar last.

Every host writes its shard pack; only the primary took host copies of packed
arrays, and writes them and the sidecar. This runs in Orbax's commit future,
so the blocking writes hold up nothing else. The pack's layout depends on the
packed sizes alone (`Prepared.take_pieces`), and its write is mostly time the
GIL is free (`pwritev`, the fsync, checksums), so it overlaps the naming of
the leaves (`Prepared.finish`, Python all the way). The sidecar goes last: it
records the checksums, and a step without it is no checkpoint. Once the pack's
write is over (durable, or failed), the host copies are let go and their
pooled buffers given back (`Prepared.give_back`): never before.
"""

import threading
from typing import Any

import jax
import numpy as np
from etils import epath

from .._format import sidecar as _sidecar
from .._format import sidecar_write as _sidecar_write
from .._format.checksum import host_sum32
from .._storage import shared as _shared
from .._storage.packed import write as _packed
from .._storage.sharded import write as _shards
from . import claim as _claim
from .prepare import Prepared


class PackWrite:
    """The write of pack 0 of a save, under way in a thread of its own; whoever
    starts one calls `result()` or `wait()` before the save ends."""

    def __init__(self, path: epath.Path, prepared: Prepared, checksums: bool):
        self.path = path
        self._sums: list[int] = []
        self._error: BaseException | None = None
        nbytes = prepared.pack_nbytes

        def run() -> None:
            try:
                pieces = prepared.take_pieces()
                self._sums = _packed.write(path, pieces, nbytes, checksums)
            except BaseException as e:  # raised by `result()`, in the save's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="orbax_eqx_pack", daemon=True)
        self._thread.start()

    def result(self) -> list[int]:
        """Each piece's checksum (none without checksums), or what the write raised."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._sums

    def wait(self) -> None:
        """Waits for the write, whatever its outcome (a save failing anyway)."""
        self._thread.join()


def start_pack(
    directory: epath.Path, token: str, prepared: Prepared, checksums: bool
) -> PackWrite | None:
    """A `PackWrite` of `prepared`'s pack, or None if this process writes none
    (no packed arrays, or not the primary host)."""
    if not (prepared.writes_pack and prepared.pack_nbytes):
        return None
    return PackWrite(directory / _sidecar.pack_file(token, 0), prepared, checksums)


def write(
    directory: epath.Path,
    prepared: Prepared,
    started: Any,
    primary: bool,
    checksums: bool,
    dedup: bool = False,
    known: Any = None,
) -> None:
    """Writes this process's files of the save `prepared` into `directory`
    (`started`: the primary host's `claim.Started`, else None). With `dedup`,
    the pack goes to the shared directory beside the steps, without the
    leaves the newest step holds already (`_storage/shared/`), and
    so do the shard packs, without the chunks it holds (`sharded.write`);
    `known`: the identities of the jax arrays this handler saved before."""
    if primary and started.identity is None:
        _claim.begin(started)
    pack = None
    try:
        if primary and not dedup:  # written meanwhile
            pack = start_pack(directory, started.token, prepared, checksums)
        prepared.finish()  # names, the sidecar's content, the rest of the copies
        assert prepared.content is not None  # (made by `finish`)
        content = prepared.content
        base = None
        if dedup:
            saved_as = content["saved_as"]
            base = _shared.base(directory, saved_as["step"], saved_as["item"], known)
        if prepared.local is not None:
            noted = started if primary else None
            _write_shards(directory, prepared, noted, dedup, base, known)
        if primary and dedup:
            _shared_pack_and_sidecar(
                directory, prepared, started, checksums, base, known
            )
        elif primary:
            _pack_and_sidecar(directory, prepared, started, pack)
    except OSError as e:  # perhaps because another save took the directory
        _claim.explain(started, e)
        raise
    finally:
        if pack is not None:
            pack.wait()  # no write of this save goes on once it ends
        prepared.drop_pieces()
        prepared.give_back()


def _write_shards(
    directory, prepared: Prepared, started: Any, dedup: bool, base: Any, known
) -> None:
    """This process's shard pack and index (with `dedup`, in the shared
    directory, against `base`: the newest step); notes them in `started`."""
    content = prepared.content
    assert content is not None and prepared.local is not None
    shared = _shared.ensure_dir(directory) if dedup else None
    for path in _shards.write(
        directory,
        content["token"],
        jax.process_index(),
        prepared.local,
        shared,
        base,
        content["leaves"],
        known if dedup else None,
    ):
        if started is not None:
            _claim.wrote(started, path)


def _shared_pack_and_sidecar(
    directory, prepared: Any, started, checksums, base, known=None
) -> None:
    """The pack of a dedup save: only the leaves the base step (its sidecar
    `base`) does not hold, into the shared directory; the sidecar refers to
    the rest where they are."""
    content = prepared.content
    planned = _shared.plan(
        content["token"],
        content,
        prepared.packed_names,
        prepared.pieces,
        base,
        prepared.packed_leaves,
        known,
    )
    _shared.apply(content, planned)
    crcs: dict[str, int] = {}
    if planned.pieces:
        path = _shared.ensure_dir(directory) / planned.file
        found = _packed.write(
            path, planned.pieces, planned.nbytes, checksums, planned.sums
        )
        crcs = dict(zip(planned.written, found, strict=False))
    prepared.drop_pieces()
    _sidecar_and_sums(directory, prepared, started, crcs)
    if known is not None:  # written: their identities hold for the next save
        for name, x in zip(prepared.packed_names, prepared.packed_leaves, strict=True):
            record = _shared.fields(content["leaves"][name])
            if record is not None:
                known.put(x, record["xxh3_128"])
        known.wrote(directory, content)


def _pack_and_sidecar(directory, prepared: Any, started, pack) -> None:
    crcs = {}
    if pack is not None:
        found = pack.result()
        _claim.wrote(started, pack.path)
        # (`found` is empty without checksums)
        crcs = dict(zip(prepared.packed_names, found, strict=False))
        prepared.drop_pieces()  # now, not after the sidecar
    _sidecar_and_sums(directory, prepared, started, crcs)


def _sidecar_and_sums(directory, prepared: Any, started, crcs: dict) -> None:
    sums = {name: host_sum32(np.asarray(x)) for name, x in prepared.sums.items()}
    _sidecar.record_checksums(prepared.content, crcs, sums)
    _claim.before_sidecar(started)
    try:
        _sidecar_write.write(directory, prepared.content)
    except FileExistsError:
        _claim.claim_failed(started)
    _claim.wrote(started, directory / _sidecar.FILE_NAME)
