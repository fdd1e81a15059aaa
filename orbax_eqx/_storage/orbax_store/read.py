"""Reads arrays from Orbax's array store: one partial restore, checked."""

import gc
import inspect
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..._errors import CheckpointDamagedError, inline_list
from ..._format.checksum import damaged, host_sum32, mismatch
from ..._format.sidecar import STORED, Metadata, arrays_dir
from ..._tree.walk import JAX, parse_dtype
from ..transfer.to_host import gather
from . import files as _store_files
from .check import check_stored
from .keys import first_line, permission_error


def read(inner, directory, saved: Metadata, requests: dict, *, verify: bool):
    """Reads the Orbax-stored leaves `{name: request}` of the checkpoint in
    `directory` (see `_restore._Request`); returns `{name: array}`."""
    # (Every Orbax-stored leaf's record has its key: `sidecar_read` checks.)
    listed = {r.key for r in saved.leaves.values() if r.data == STORED and r.key}
    store = arrays_dir(directory, saved.token)
    # Nothing may block: the files this read opens are files, first.
    wanted = {r.record.key for r in requests.values() if r.record.key}
    _store_files.check(store, skip=listed - wanted)
    check_stored(store, [r.record for r in requests.values()], listed)
    loaded = _orbax_read(inner, store, requests)
    if verify:
        _check_sums(directory, requests, loaded)
    return loaded


def _orbax_read(inner, directory, to_read: dict) -> dict[str, Any]:
    item, restore_args = {}, {}
    for name, request in to_read.items():
        record = request.record
        key = record.key  # derived from the name (see `_sidecar_read`)
        cast = None if _same_dtype(record.dtype, request.dtype) else request.dtype
        if request.container == JAX:
            item[key] = jax.ShapeDtypeStruct(
                record.shape,
                _saved_dtype(record.dtype, request.dtype),
                sharding=request.sharding,
            )
            restore_args[key] = ocp.ArrayRestoreArgs(
                sharding=request.sharding, dtype=cast
            )
        else:
            item[key] = jax.ShapeDtypeStruct(record.shape, parse_dtype(record.dtype))
            restore_args[key] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=cast)
    try:
        restored = inner.restore(
            directory,
            args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True
            ),
        )
    except Exception as e:  # Orbax raises bare `Exception`s for TensorStore's
        cause = storage_error(e)
        denied = permission_error(e, directory)
        records = [request.record for request in to_read.values()]
        if denied is not None:
            error: Exception = denied
        elif cause is not None:
            error = unreadable(directory, records, cause)
        else:
            raise
        _drop_tracebacks(e)  # they hold the reads Orbax abandoned
        error.__cause__ = e  # the whole of Orbax's message, for --debug
    else:
        return {name: restored[r.record.key] for name, r in to_read.items()}
    _collect_quietly()
    raise error


def _drop_tracebacks(first: BaseException | None) -> None:
    todo: list[BaseException | None] = [first]
    seen = set()
    while todo:
        error = todo.pop()
        if error is not None and id(error) not in seen:
            seen.add(id(error))
            error.__traceback__ = None
            todo += [error.__cause__, error.__context__]


def _collect_quietly() -> None:
    """Collects the reads Orbax abandons when one fails, without their noise."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not inspect.iscoroutine(unraisable.object):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous


# What TensorStore says when files are missing, short or corrupt.
_STORAGE_SIGNS = ("DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND", "OUT_OF_RANGE")


def storage_error(first: BaseException) -> str | None:
    """The first line of a TensorStore error in `first`'s chain, if any."""
    error: BaseException | None = first
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if any(sign in text for sign in _STORAGE_SIGNS):
            return first_line(error)
        error = error.__cause__ or error.__context__
    return None


def unreadable(directory, records, cause: str) -> CheckpointDamagedError:
    names = [f"`{r.path}` ({r.name})" for r in records]
    return CheckpointDamagedError(
        f"Reading leaves {inline_list(names, 5)} from Orbax's array store of the "
        f"checkpoint at {directory} failed ({cause}): the checkpoint is damaged "
        "(a file deleted, cut short or changed). Restore an earlier step, or "
        "re-save the checkpoint; `python -m orbax_eqx verify PATH` lists each "
        "damaged leaf."
    )


def _check_sums(directory, requests: dict, loaded: dict) -> None:
    """Raises if an array read through Orbax differs from its recorded `sum32`."""
    found = {}
    for name, request in requests.items():
        record = request.record
        if record.sum32 is None or not _same_dtype(record.dtype, request.dtype):
            continue
        x = loaded[name]
        if request.container != JAX:
            found[name] = host_sum32(np.asarray(x))
        elif x.is_fully_addressable:
            found[name] = host_sum32(gather(x))
    problems = [
        mismatch(requests[name].record, "sum32", requests[name].record.sum32, int(s))
        for name, s in found.items()
        if int(s) != requests[name].record.sum32
    ]
    if problems:
        raise damaged(directory, problems)


def _same_dtype(saved: str, target: Any) -> bool:
    return saved == str(target)


def _saved_dtype(saved: str, target: Any) -> Any:
    return target if _same_dtype(saved, target) else parse_dtype(saved)
