"""Saves refused before they write anything: what a save on an object store
needs of Orbax, checked before it starts, and leaving nothing behind (the
directories Orbax made for it in the background are waited for and removed).

Orbax commits a checkpoint either by renaming a temporary directory (its
default off `gs://`) or by writing `commit_success.txt` last (its default on
`gs://`). S3 has no directories to rename: s3fs copies each object of the
prefix, and the copy fails ("The specified key does not exist") after every
byte was written. So on `s3://` a save must run under the commit-file mode,
which `oeqx.save` chooses itself and a `CheckpointManager` is given with
`CheckpointManagerOptions(temporary_path_class=...)`. Orbax's own array
writer (`pack=False`) builds TensorStore specs for `gs://` and local paths
only, so on `s3://` arrays must go in packs.

The first save of a process into a bucket also asks the store once whether
it is reachable and the bucket exists (`reachable`): under a
`CheckpointManager`, whose own directory calls may have passed without either,
the save then says which bucket, which endpoint and what to set, rather than
failing on its first write.
"""

import asyncio
import os
import threading
import time

import orbax.checkpoint as ocp
from etils import epath

from .._bytes import route as _route
from .._bytes.route import is_remote
from .._errors import ObjectStoreSaveError
from .._save import futures as _futures

_reached: set[str] = set()  # "gs://bucket" roots this process reached
_lock = threading.Lock()

COMMIT_FILE = ocp.path.atomicity.CommitFileTemporaryPath
_RENAMED = ocp.path.atomicity.TMP_DIR_SUFFIX


def check(directory: os.PathLike, pack: bool) -> None:
    """Raises `ObjectStoreSaveError` for a save into item directory
    `directory` that would fail on its store."""
    text = os.fspath(directory)
    if not text.startswith("s3://"):
        return
    if _RENAMED in text:
        raise ObjectStoreSaveError(
            f"Saving to {text}, a temporary directory that Orbax would rename "
            "to commit the checkpoint: S3 cannot rename a directory, so the "
            "save would fail after writing everything. Let Orbax commit with a "
            "commit file, as it does on gs://: pass `options=ocp."
            "CheckpointManagerOptions(temporary_path_class=ocp.path.atomicity."
            "CommitFileTemporaryPath)` to the CheckpointManager (or "
            "`temporary_path_class=` to `ocp.Checkpointer`), or save with "
            "`oeqx.save`, which does this itself."
        )
    if not pack:
        raise ObjectStoreSaveError(
            f"Saving to {text} with `EqxHandler(pack=False)`: Orbax's own array "
            "store cannot write to s3:// (its writer knows gs:// and local "
            "paths only). Leave `pack=True` (the default): orbax_eqx's packs "
            "and shard packs are written to S3 directly."
        )


def reachable(directory: os.PathLike) -> None:
    """Raises `ObjectStoreError` (bucket, endpoint, what to set) unless the
    bucket of `directory` answers and exists; asked once per bucket and
    process, on its first save. Nothing for local paths."""
    text = os.fspath(directory)
    if not is_remote(text):
        return
    scheme, _, rest = text.partition("://")
    root = f"{scheme}://{rest.split('/', 1)[0]}"
    with _lock:
        if root in _reached:
            return
    _route.for_path(directory).check_reachable(directory)
    with _lock:
        _reached.add(root)


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
