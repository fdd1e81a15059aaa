"""A checkpoint deleted while it is restored: said so, not reported as damage.

A `CheckpointManager` with `max_to_keep` deletes old steps as new ones are
saved, perhaps in another process; a restore that listed the steps a moment
earlier then finds files gone part way and fails with whatever the read hit
first (`FileNotFoundError`, `NotADirectoryError`, a TensorStore error, a
missing sidecar). If the checkpoint is gone once the restore has failed, that
deletion is what happened, and the error says so.
"""

import contextlib
import os
from collections.abc import Iterator

from etils import epath

from .._errors import (
    CheckpointDamagedError,
    CheckpointNotFoundError,
    OrbaxEqxError,
    SidecarError,
)
from .._format.sidecar import FILE_NAME


class CheckpointDeletedError(CheckpointNotFoundError):
    """The checkpoint was deleted while it was being restored."""


@contextlib.contextmanager
def noticed(directory: epath.Path | str) -> Iterator[None]:
    """Turns a failure of a restore of `directory` into `CheckpointDeletedError`
    if `directory` and its sidecar were there before and are not afterwards."""
    directory = epath.Path(directory)
    there = _still_there(directory)  # else the failure says what is missing
    try:
        yield
    except Exception as e:
        if not there or not _ours_to_explain(e) or _still_there(directory):
            raise
        raise deleted(directory) from e


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
    if isinstance(e, (OSError, SidecarError, CheckpointDamagedError)):
        return not isinstance(e, CheckpointDeletedError)
    return not isinstance(e, OrbaxEqxError)  # Orbax's and TensorStore's own


def _still_there(directory: epath.Path) -> bool:
    if "://" in os.fspath(directory):
        return True  # object stores have no directories to vanish; say nothing
    return os.path.isdir(directory) and os.path.isfile(directory / FILE_NAME)
