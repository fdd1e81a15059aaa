"""A save's own files, written in its background thread: the shard packs, the
pack (while the leaves are named, `pack_write`), and the sidecar last.

Every host writes its shard pack; only the primary took host copies of packed
arrays, and writes them and the sidecar. This runs in a thread of its own
(Orbax's commit future), so the blocking writes hold up nothing else. The
sidecar goes last: it records the checksums, and a step without it is no
checkpoint. Once the pack's write is over (durable, or failed), the host
copies are let go and their pooled buffers given back (`Prepared.give_back`):
never before.
"""

from typing import Any

import jax
import numpy as np
from etils import epath

from .._format import sidecar as _sidecar
from .._format import sidecar_write as _sidecar_write
from .._format.checksum import host_sum32
from .._storage.sharded import write as _shards
from . import claim as _claim
from . import pack_write as _pack_write
from .prepare import Prepared


def write(
    directory: epath.Path,
    prepared: Prepared,
    started: Any,
    primary: bool,
    checksums: bool,
) -> None:
    """Writes this process's files of the save `prepared` into `directory`
    (`started`: the primary host's `claim.Started`, else None)."""
    if primary and started.identity is None:
        _claim.begin(started)
    pack = None
    try:
        if primary:  # written meanwhile: `pack_write`
            pack = _pack_write.start(directory, started.token, prepared, checksums)
        prepared.finish()  # names, the sidecar's content, the rest of the copies
        assert prepared.content is not None  # (made by `finish`)
        if prepared.local is not None:
            token = prepared.content["token"]
            process = jax.process_index()
            for path in _shards.write(directory, token, process, prepared.local):
                if primary:
                    _claim.wrote(started, path)
        if primary:
            _pack_and_sidecar(directory, prepared, started, pack)
    except OSError as e:  # perhaps because another save took the directory
        _claim.explain(started, e)
        raise
    finally:
        if pack is not None:
            pack.wait()  # no write of this save goes on once it ends
        prepared.drop_pieces()
        prepared.give_back()


def _pack_and_sidecar(directory, prepared: Any, started, pack) -> None:
    crcs = {}
    if pack is not None:
        found = pack.result()
        _claim.wrote(started, pack.path)
        # (`found` is empty without checksums)
        crcs = dict(zip(prepared.packed_names, found, strict=False))
        prepared.drop_pieces()  # now, not after the sidecar
    sums = {name: host_sum32(np.asarray(x)) for name, x in prepared.sums.items()}
    _sidecar.record_checksums(prepared.content, crcs, sums)
    _claim.before_sidecar(started)
    try:
        _sidecar_write.write(directory, prepared.content)
    except FileExistsError:
        _claim.claim_failed(started)
    _claim.wrote(started, directory / _sidecar.FILE_NAME)
