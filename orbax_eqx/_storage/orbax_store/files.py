"""Orbax's array store, walked before anything reads it: files and directories only."""

import os
import stat
from collections.abc import Collection

from etils import epath

from ..._bytes import files as _files
from ..._bytes.route import is_remote
from ..._errors import CheckpointDamagedError, permission_denied

# Far more than Orbax writes: a store without OCDBT has a directory, a
# metadata file and a file per chunk for each array.
MAX_ENTRIES = 1 << 20


def check(
    store: epath.Path, *, skip: Collection[str] = (), saving: bool = False
) -> None:
    """Raises `CheckpointDamagedError` if Orbax's array store at `store` holds
    anything but regular files and directories, or more than `MAX_ENTRIES`."""
    top = os.fspath(store)
    if is_remote(top):
        return
    try:
        mode = os.stat(top).st_mode
    except FileNotFoundError:
        return
    except PermissionError:
        raise permission_denied(store) from None
    if not stat.S_ISDIR(mode):
        raise _refused(store, top, _files.kind(mode), saving)
    seen, todo = 0, [top]
    while todo:
        directory = todo.pop()
        try:
            entries = os.scandir(directory)
        except FileNotFoundError:  # deleted meanwhile: the reads say so
            continue
        except PermissionError:
            raise permission_denied(directory) from None
        with entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    raise _too_many(store, saving)
                if directory == top and entry.name in skip:
                    continue
                found = _what(entry)
                if found == "directory":
                    todo.append(entry.path)
                elif found is not None:
                    raise _refused(store, entry.path, found, saving)


def _what(entry: os.DirEntry) -> str | None:
    """None for a regular file (or a link to one), "directory" for a
    directory, else what the entry is, for the message."""
    try:
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
            return "directory"
        if stat.S_ISREG(mode):
            return None
        if not stat.S_ISLNK(mode):
            return _files.kind(mode)
        target = os.stat(entry.path).st_mode  # a link: what it names
    except FileNotFoundError:  # gone meanwhile, or a dangling link
        return None  # the reads say what is missing
    if stat.S_ISREG(target):
        return None
    return f"a symbolic link to {_files.kind(target)}"


def _item(store: epath.Path) -> str:
    """The checkpoint the store belongs to: its item directory."""
    store = epath.Path(store)
    return os.fspath(store.parent if store.name.startswith("orbax_eqx~") else store)


def _refused(store, path: str, found: str, saving: bool) -> CheckpointDamagedError:
    if path == os.fspath(store):
        what = f"is {path}, which is {found}, not a directory"
    else:
        what = (
            f"holds {path}, which is {found} where Orbax writes only regular "
            "files and directories"
        )
    return _damaged(store, what, saving)


def _too_many(store, saving: bool) -> CheckpointDamagedError:
    return _damaged(
        store,
        f"holds more than {MAX_ENTRIES} files and directories, far more than "
        "Orbax writes",
        saving,
    )


def _damaged(store, what: str, saving: bool) -> CheckpointDamagedError:
    if saving:
        return CheckpointDamagedError(
            f"Orbax's array store of the save under way in {_item(store)} {what}: "
            "something other than this save wrote into its directory while it "
            "ran. Reading it could block forever or without end, so the save "
            "stopped before its commit and no checkpoint was changed. Find what "
            "writes into the checkpoint directory, then save again."
        )
    return CheckpointDamagedError(
        f"Orbax's array store of the checkpoint at {_item(store)} {what}. "
        "Reading it could block forever or without end, so nothing was read: "
        "the checkpoint is damaged (or something else was put in its place). "
        "Restore an earlier step, or re-save the checkpoint."
    )
