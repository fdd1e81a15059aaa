"""A checkpoint deleted or replaced while it is restored: said so, not
reported as damage.

A `CheckpointManager` with `max_to_keep` deletes old steps as new ones are
saved, perhaps in another process; a restore that listed the steps a moment
earlier then finds files gone part way and fails with whatever the read hit
first (`FileNotFoundError`, `NotADirectoryError`, a TensorStore error, a
missing sidecar, a short file). Likewise `oeqx.save(path, overwrite=True)` in
another job swaps a new checkpoint in under a restore of `path`. If, once the
restore has failed, the checkpoint is gone, that deletion is what happened;
if its sidecar is another file than the one there when the restore began, it
was replaced (the handler then restores the new one, once). A deletion in
progress may have removed data files and not yet the sidecar, or the sidecar
and not yet the rest, before the restore began: when the read found a file
missing, or files went missing meanwhile, the check looks again for a moment
before it lets the error stand (on an object store, whose objects are not
listed here, always). Which sidecar is there is
asked of the byte layer, so that a disk and an object store tell the same:
its inode and change time, or its object's generation. A store that fails
to answer is said so (`ObjectStoreError`), not taken for a deletion.
"""

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from etils import epath

from .._bytes import route as _route
from .._errors import (
    CheckpointDamagedError,
    CheckpointNotFoundError,
    ObjectStoreError,
    OrbaxEqxError,
    SidecarError,
)
from .._format.sidecar import FILE_NAME


class CheckpointDeletedError(CheckpointNotFoundError):
    """The checkpoint was deleted while it was being restored."""


class CheckpointReplacedError(OrbaxEqxError, RuntimeError):
    """The checkpoint was replaced by another save while it was being restored."""


# How long a failed restore watches for a deletion in progress to finish.
SETTLE_S = 0.5
_SETTLE_STEP_S = 0.05


@contextlib.contextmanager
def noticed(directory: epath.Path | str) -> Iterator[None]:
    """Turns a failure of a restore of `directory` into `CheckpointDeletedError`
    if `directory` and its sidecar were there before and are not afterwards,
    and into `CheckpointReplacedError` if its sidecar is another file now."""
    directory = epath.Path(directory)
    before = _identity(directory)  # None: no sidecar, perhaps deleted already
    remote = _route.is_remote(directory)
    entries = _entries(directory) if before is not _UNKNOWN else set()
    try:
        yield
    except Exception as e:
        if before is _UNKNOWN or not _ours_to_explain(e):
            raise
        found = _what_happened(directory, e, before, entries, remote)
        if found is None:
            raise
        raise found from e


def _what_happened(
    directory: epath.Path, e: Exception, before: Any, entries: set[str], remote: bool
) -> Exception | None:
    """The error to raise for a restore of `directory` that failed with `e`
    when it was deleted or replaced meanwhile, or None: `e` stands."""
    if before is None:
        if entries and _emptying(directory, entries):
            return deleted(directory)
        return None  # the failure says what is missing
    # Only if files went missing meanwhile, or the read found one missing:
    # a deletion may be under way. (Damage found in files that are all
    # there is said at once.)
    settling = remote or _missing(e) or not entries <= _entries(directory)
    deadline = time.monotonic() + (SETTLE_S if settling else 0.0)
    while True:
        now = _identity(directory)
        if now is None:
            return deleted(directory)
        if now is _UNKNOWN:
            return None
        if now != before:
            return replaced(directory)
        if time.monotonic() >= deadline:
            return None
        time.sleep(_SETTLE_STEP_S)


def _emptying(directory: epath.Path, entries: set[str]) -> bool:
    """Whether `directory`, which held `entries` but no sidecar when the
    restore began, loses files or goes within `SETTLE_S`: a deletion that
    took the sidecar first (a manager's `max_to_keep` deletes files in any
    order), not a checkpoint that never had one."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        if not entries <= _entries(directory):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_SETTLE_STEP_S)


def replaced(directory) -> CheckpointReplacedError:
    """The error for a checkpoint replaced while it was being restored."""
    return CheckpointReplacedError(
        f"The checkpoint at {directory} was replaced by another save while it "
        "was being restored (`save(..., overwrite=True)`, or a save of the same "
        "step, perhaps in another process); nothing is damaged. Restore it "
        "again to read the new one, or save to separate paths."
    )


def deleted(directory) -> CheckpointDeletedError:
    """The error for a checkpoint deleted while it was being restored."""
    # The read's own error, chained as the cause, would call the files damaged.
    return CheckpointDeletedError(
        f"The checkpoint at {directory} was deleted while it was being restored, "
        "as a CheckpointManager with `max_to_keep` (perhaps in another process) "
        "deletes old steps when it saves new ones. Restore a step that is kept "
        "(call `mngr.reload()`, then `mngr.latest_step()`), or use "
        "`oeqx.restore_latest(mngr, args)`, which moves on to the newest step left."
    )


def _ours_to_explain(e: Exception) -> bool:
    # What a read of vanishing files raises; not a mismatch of the skeleton or
    # a bad option, which is the caller's whatever happened to the files.
    if isinstance(e, (CheckpointDeletedError, CheckpointReplacedError)):
        return False
    if isinstance(e, ObjectStoreError):  # the store failed, whatever is there
        return False
    if isinstance(e, (OSError, SidecarError, CheckpointDamagedError)):
        return True
    return not isinstance(e, OrbaxEqxError)  # Orbax's and TensorStore's own


def _missing(e: BaseException) -> bool:
    """Whether the read failed at a file that is not there: an `OSError` of
    one, or TensorStore's NOT_FOUND, anywhere in `e`'s chain (our errors
    that say a file is missing keep the read's as their context)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, (FileNotFoundError, NotADirectoryError)):
            return True
        if "NOT_FOUND" in str(x):
            return True
        x = x.__cause__ or x.__context__
    return False


def _entries(directory: epath.Path) -> set[str]:
    """The names in `directory` and in its subdirectories (one level down:
    Orbax's array store, typed groups), to tell files deleted meanwhile."""
    if _route.is_remote(directory):
        return set()
    found = set()
    try:
        with os.scandir(directory) as top:
            for entry in top:
                found.add(entry.name)
                if entry.is_dir(follow_symlinks=False):
                    try:
                        found.update(
                            f"{entry.name}/{n}" for n in os.listdir(entry.path)
                        )
                    except OSError:
                        pass
    except OSError:
        pass
    return found


_UNKNOWN = object()  # `_identity` of a store that did not answer


def _identity(directory: epath.Path) -> Any:
    """Which sidecar file `directory` holds (see `Store.version`: every save
    writes a new one), None if it holds none, `_UNKNOWN` if the store did not
    say."""
    path = directory / FILE_NAME
    try:
        return _route.for_path(path).version(path)
    except ObjectStoreError:
        return _UNKNOWN
