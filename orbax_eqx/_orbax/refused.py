"""A save refused before it wrote anything leaves nothing behind: the
directories Orbax made for it in the background are waited for and removed."""

import asyncio
import os
import time

from etils import epath

from .._bytes.paths import is_remote
from .._save import futures as _futures

# How long a refused save waits for Orbax to make its directories.
_DIRECTORIES_WAIT_S = 30.0
_ORBAX_TMP = ".orbax-checkpoint-tmp"
_STEP_METADATA = "_CHECKPOINT_METADATA"


async def undo_directories(directory: epath.Path, primary: bool) -> None:
    """Waits for Orbax's background making of this save's directories (its
    "directory made" signals), then, on the primary host, removes the item
    directory if empty and the temporary step directory around it if it
    holds only Orbax's step metadata: a save refused before writing leaves
    nothing behind.

    Orbax writes the step metadata (`_CHECKPOINT_METADATA`) in a thread of
    its own after the signal; the step directory goes only once that file is
    there, else Orbax's write would find no directory and fail the manager's
    next call (`FileNotFoundError`). If it never comes, the directory stays
    (Orbax replaces a leftover temporary directory on the next save).
    """

    async def nothing() -> None:
        return None

    made = _futures.commit_future(nothing(), name="orbax_eqx_refused")
    try:
        await asyncio.to_thread(made.result, _DIRECTORIES_WAIT_S)
    except Exception:  # not made in time, or could not be: leave it to Orbax
        return
    if not primary or is_remote(directory):
        return
    try:
        os.rmdir(directory)  # fails unless empty
        step = directory.parent
        if _ORBAX_TMP not in step.name:
            return
        if not await asyncio.to_thread(_appears, step / _STEP_METADATA):
            return
        if set(os.listdir(step)) <= {_STEP_METADATA}:
            for name in os.listdir(step):
                os.remove(step / name)
            os.rmdir(step)
    except OSError:
        pass  # something else is there: keep it


def _appears(path: epath.Path) -> bool:
    """Whether `path` exists within `_DIRECTORIES_WAIT_S`. Once it does, Orbax's
    write of it has opened it: removing it and its directory then harms no
    write (the open file is written and dropped)."""
    deadline = time.monotonic() + _DIRECTORIES_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
