"""Orbax's array store, opened as TensorStore opens it: its keys, and which of
a save's arrays it still holds whole (`missing_in_store`, the save's check
before it commits). Shared by the save and by the restore's checks
(`check.py`); imports nothing of the restore.
"""

import os
import re
from collections.abc import Sequence

import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from ..._bytes.route import is_remote
from ..._errors import (
    CheckpointDamagedError,
    CheckpointPermissionError,
    permission_denied,
)

# The zarr metadata record of a stored array, version 2 and 3.
ZARR2 = ".zarray"
ZARR3 = "zarr.json"


def missing_in_store(directory: epath.Path, keys: Sequence[str]) -> list[str]:
    """Those of `keys` whose arrays Orbax's store at `directory` no longer holds
    whole: their metadata record, or a data file of theirs, gone."""
    try:
        store = open_store(directory)
        listed = store.list().result()
        firsts = [store.read(k, byte_range=slice(0, 1)) for k in listed]
        whole, broken = set(), set()
        for k, first in zip(listed, firsts, strict=True):
            # `<storage key>/<zarr metadata or chunk>`: storage keys hold no `/`.
            key, _, rest = k.decode("utf-8", "surrogateescape").partition("/")
            if rest in (ZARR2, ZARR3):
                whole.add(key)
            if first.result().state != "value" or not first.result().value:
                broken.add(key)
    except Exception:  # the store, or its index, is gone
        return list(keys)
    return [k for k in keys if k not in whole or k in broken]


def open_store(directory: epath.Path) -> ts.KvStore:
    text = os.fspath(directory).rstrip("/") + "/"
    base = text if is_remote(text) else "file://" + text
    # As Orbax decides it, so that both read the same store.
    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(directory)
    spec = {"driver": "ocdbt", "base": base} if ocdbt else base
    try:
        return ts.KvStore.open(spec).result()
    except Exception as e:
        denied = permission_error(e, directory)
        if denied is not None:
            raise denied from None
        raise CheckpointDamagedError(
            f"Orbax's array store of the checkpoint at {directory} cannot be "
            f"opened ({first_line(e)}): the checkpoint is damaged. Restore an "
            "earlier step, or re-save the checkpoint."
        ) from e


def first_line(e: BaseException) -> str:
    """The gist of a TensorStore error, without the pages of spec it appends."""
    text = str(e).split("\n", 1)[0]
    for tail in (" [tensorstore_spec", ". See full TensorStore details"):
        text = text.split(tail, 1)[0]
    # The start and the end, which says what was wrong ("Invalid bool value").
    return text if len(text) <= 300 else f"{text[:147]} ... {text[-148:]}"


# How TensorStore names a file it may not open.
_DENIED = re.compile(r'"([^"]+)": Permission denied')


def permission_error(
    error: BaseException | None, where: object
) -> CheckpointPermissionError | None:
    """`permission_denied` for a TensorStore error in `error`'s chain that says
    a file may not be read, naming that file (else `where`); None if none does."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if "PERMISSION_DENIED" in text:
            named = _DENIED.search(text)
            return permission_denied(named.group(1) if named else where)
        error = error.__cause__ or error.__context__
    return None
