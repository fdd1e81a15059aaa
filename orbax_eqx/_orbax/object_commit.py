"""What a save on an object store needs of Orbax, checked before it starts.

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
`CheckpointManager`, whose own directory calls may have passed without either
(gcsfs makes no bucket and may not check one), the save then says which
bucket, which endpoint and what to set, rather than failing on its first
write.
"""

import os
import threading

import orbax.checkpoint as ocp

from .._bytes import route as _route
from .._bytes.paths import is_remote
from .._errors import ObjectStoreSaveError

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
