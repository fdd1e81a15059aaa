"""Replacing a standalone checkpoint whole: never a moment without one.

`save(path, item, overwrite=True)` writes the new checkpoint beside the old
one (`NEW`, committed there by Orbax), then swaps it in: with Linux's
`renameat2(RENAME_EXCHANGE)` in one call; elsewhere `path` -> `OLD`, `NEW` ->
`path`, and a restore that finds `path` missing beside an `OLD` waits
(`SWAP_WAIT_S`) or renames it back (`recover`). Killed at any instant, `path`
holds the old checkpoint or the new one, whole; the next save deletes what a
dead save left beside it (`tidy`): only of owners on this host that are dead
or this process's saves that ended. Only checkpoints are ever replaced
(`check_target`).
"""

import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator

import jax
from etils import epath

from .._bytes.route import is_remote
from .._errors import OrbaxEqxError, some
from .._format.locate import is_item, steps_in
from .._format.sidecar import FILE_NAME
from .claim import ConcurrentSaveError, from_process


class CheckpointExistsError(OrbaxEqxError, FileExistsError):
    """`save` was asked to write where a checkpoint already is."""


class NotACheckpointError(CheckpointExistsError):
    """`save` was asked to write where something other than an orbax_eqx
    checkpoint is (a file, a link, a directory of other files)."""


def check_target(path: epath.Path, overwrite: bool) -> None:
    """Raises unless a save may write `path`: missing, or a checkpoint (or an
    empty directory) when `overwrite`."""
    if not _lexists(path):
        return
    # Asked first: `overwrite=True` is offered only where it would work.
    found = _not_a_checkpoint(path)
    if found is not None:
        what, fix = found
        if overwrite:
            raise NotACheckpointError(
                f"Cannot replace {path}: it is {what}, not an orbax_eqx "
                "checkpoint, and overwriting replaces only checkpoints; nothing "
                f"was changed. {fix}"
            )
        raise NotACheckpointError(
            f"Cannot save to {path}: it is {what}, not an orbax_eqx checkpoint, "
            "and a save replaces only checkpoints (with `overwrite=True`); "
            f"nothing was changed. {fix}"
        )
    if not overwrite:
        raise CheckpointExistsError(
            f"{path} already exists. Pass `overwrite=True` to replace it, or "
            "choose another directory."
        )


# What Orbax writes at the top of a checkpoint, beside its item directories.
_ORBAX_TOP_FILES = frozenset(
    {"_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt"}
)

_ELSEWHERE = (
    "Choose another directory, or move or delete it yourself if it is not needed."
)
_MOVE_OUT = (
    "Overwriting deletes the whole directory: move those entries out of it "
    "first, or choose another directory."
)
# Each kind of non-checkpoint (found by `_what_else`): its words and the fix.
_WORDS = {
    "link": ("a symbolic link (to {target})", _ELSEWHERE),
    "file": ("a file", _ELSEWHERE),
    "item with others": (
        "a directory holding a checkpoint's files and entries neither orbax_eqx "
        "nor Orbax wrote ({odd})",
        _MOVE_OUT,
    ),
    "separate items": (
        "a directory of {count} checkpoint(s) each saved on its own ({alone})",
        "To replace one of them, save to its path (such as {first}) instead; else "
        "choose another directory.",
    ),
    "step with others": (
        "a step of checkpoints whose item directories also hold entries neither "
        "orbax_eqx nor Orbax wrote ({odd})",
        _MOVE_OUT,
    ),
    "items among others": (
        "a directory holding the checkpoint{plural} {held} beside other entries "
        "({others})",
        "To replace a checkpoint in it, save to its path ({such}{first}) instead; "
        "else choose another directory.",
    ),
    "manager root": ("a CheckpointManager root (steps {steps})", _ELSEWHERE),
    "other files": (
        "a directory of other files ({names}; no {sidecar} in it or its "
        "subdirectories)",
        _ELSEWHERE,
    ),
}


def _not_a_checkpoint(path: epath.Path) -> tuple[str, str] | None:
    """`(what is at path, the fix)` if it is no checkpoint, else None."""
    try:
        found = _what_else(path)
    except FileNotFoundError:
        return None
    if found is None:
        return None
    kind, details = found
    what, fix = _WORDS[kind]
    return what.format(**details), fix.format(**details)


_Found = tuple[str, dict[str, object]] | None


def _what_else(path: epath.Path) -> _Found:
    """The kind (a key of `_WORDS`) and details of what is at `path`, unless
    it is a checkpoint (deleting it deletes nothing else), empty or missing."""
    if not _lexists(path):
        return None
    local = not is_remote(path)
    if local and os.path.islink(os.fspath(path)):
        return "link", {"target": os.readlink(os.fspath(path))}
    if not path.is_dir():
        return "file", {}
    if is_item(path):
        odd = foreign(path)
        return ("item with others", {"odd": some(odd)}) if odd else None
    entries = list(path.iterdir())
    return _what_holds(path, entries) if entries else None


def _what_holds(path: epath.Path, entries: list[epath.Path]) -> _Found:
    items = sorted(p for p in entries if p.is_dir() and is_item(p))
    if items:
        return _what_items(items, entries)
    steps = steps_in(path)
    if steps:
        return "manager root", {"steps": ", ".join(str(s) for s, _ in steps[-10:])}
    names = sorted(p.name for p in entries)
    return "other files", {"names": some(names), "sidecar": FILE_NAME}


def _what_items(items: list[epath.Path], entries: list[epath.Path]) -> _Found:
    others = sorted(
        p.name
        for p in entries
        if p not in items and not (p.name in _ORBAX_TOP_FILES and p.is_file())
    )
    if not others:
        return _what_step(items)
    return "items among others", {
        "plural": "s" if len(items) > 1 else "",
        "held": some([p.name for p in items]),
        "others": some(others),
        "such": "" if len(items) == 1 else "such as ",
        "first": items[0],
    }


def _what_step(items: list[epath.Path]) -> _Found:
    # Orbax puts a standalone save's metadata in its item directory.
    alone = [p.name for p in items if (p / _STEP_METADATA).exists()]
    if alone:
        return "separate items", {
            "count": len(items),
            "alone": some(alone),
            "first": items[0],
        }
    odd = [f"{p.name}/{name}" for p in items for name in foreign(p)]
    return ("step with others", {"odd": some(odd)}) if odd else None


_STEP_METADATA = "_CHECKPOINT_METADATA"
# What Orbax writes in an item directory.
_ORBAX_ITEM_FILES = frozenset(
    {
        *_ORBAX_TOP_FILES,
        "_sharding",
        "manifest.ocdbt",
        "d",
        "array_metadatas",
        "descriptor",
    }
)
_OCDBT_PROCESS = re.compile(r"ocdbt\.process_[0-9]+")


def foreign(item: epath.Path) -> list[str]:
    """Entries of item directory `item` that neither orbax_eqx nor Orbax wrote
    (overwriting would delete them)."""
    return sorted(
        p.name
        for p in item.iterdir()
        if not (
            p.name == FILE_NAME
            or p.name.startswith((FILE_NAME + ".tmp-", "orbax_eqx~"))
            or p.name in _ORBAX_ITEM_FILES
            or _OCDBT_PROCESS.fullmatch(p.name)
        )
    )


def publish(new: epath.Path, path: epath.Path, owner: "Owner", overwrite: bool) -> None:
    """Puts the committed checkpoint `new` at `path`, replacing one there
    if `overwrite`. Raises `ConcurrentSaveError` if another save put its
    checkpoint there meanwhile; `new` is then the caller's to remove."""
    if not overwrite or not _lexists(path):
        _rename_into_place(new, path)
        return
    found = _not_a_checkpoint(path)
    if found is not None:  # put there while this save ran
        what, fix = found
        raise NotACheckpointError(
            f"Cannot replace {path}: while this save ran it became {what}; "
            f"nothing was changed. {fix}"
        )
    old = beside(path, owner, OLD)
    try:
        exchanged = _exchange(new, path)
    except FileNotFoundError:  # another save is swapping it: path is missing
        _rename_into_place(new, path)
        return
    if exchanged:
        try:  # `new` names the old checkpoint now: named as what it is
            os.rename(os.fspath(new), os.fspath(old))
        except OSError:
            old = new
    else:
        try:
            os.rename(os.fspath(path), os.fspath(old))
        except FileNotFoundError:  # another save moved it away just now
            _rename_into_place(new, path)
            return
        try:
            os.rename(os.fspath(new), os.fspath(path))
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                os.rename(os.fspath(old), os.fspath(path))  # put the old one back
                raise
            remove(old)  # replaced already by the other save's
            raise _lost(
                path, "put its checkpoint there between this save's two renames"
            ) from None
    _sync_directory(path.parent)
    remove(old)


def _rename_into_place(new: epath.Path, path: epath.Path) -> None:
    """`new` -> `path`, where `path` is missing (or an empty directory)."""
    try:
        os.rename(os.fspath(new), os.fspath(path))
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise _lost(path, "saved a checkpoint there while this one ran") from None
    _sync_directory(path.parent)


def _lost(path: epath.Path, what: str) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"Another save to {path} {what}, so this save was not put in its place "
        "and its files were removed; the other save's checkpoint is kept whole. "
        "Two processes are saving to one path: give each its own, or save one "
        "after the other."
    )


# TensorStore may go on writing a failed save's arrays: its directory is
# deleted until it stays gone this long (at most 50 times).
_QUIET_S = 0.2


def discard(new: epath.Path) -> None:
    """Removes a failed save's new checkpoint and Orbax's temporary one."""
    if is_remote(new):
        return
    paths = [new.parent / (new.name + ORBAX_TMP), new]
    for _ in range(50):
        for path in paths:
            remove(path)
        time.sleep(_QUIET_S)
        if not any(os.path.lexists(os.fspath(p)) for p in paths):
            return


def _lexists(path: epath.Path) -> bool:
    if is_remote(path):
        return path.exists()
    return os.path.lexists(os.fspath(path))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: epath.Path, b: epath.Path) -> bool:
    """Exchanges the names `a` and `b` at once; False where the system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    result = renameat2(
        _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not here
        return False
    raise OSError(code, os.strerror(code), os.fspath(a), None, os.fspath(b))


@functools.cache
def _renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2  # glibc 2.28 and later
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p] * 2 + [ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _sync_directory(directory: epath.Path) -> None:
    """Makes the renames in `directory` durable (a power cut, not only a kill)."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


NEW, OLD = "new", "old"
ORBAX_TMP = ".orbax-checkpoint-tmp"  # what Orbax adds to a directory it writes
SWAP_WAIT_S = 2.0
# Longer names are hashed in the names beside them (255-byte file names).
_LONGEST_STEM = 120
_FIELDS = re.compile(
    r"(?P<kind>new|old)-(?P<token>[0-9a-f]{8})-(?P<pid>[0-9]{1,10})-"
    r"(?P<host>[A-Za-z0-9-]{1,32})(\.orbax-checkpoint-tmp.*)?"
)


def _host_name() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


HOST = _host_name()


@dataclasses.dataclass(frozen=True)
class Owner:
    """The save that owns directories beside a target."""

    token: str
    pid: int
    host: str

    def alive(self) -> bool | None:
        """Whether the owner still runs; None if it is on another host."""
        if self.host != HOST:
            return None
        if self.pid == os.getpid():  # this process: a save of it under way?
            return self.token in _SAVING
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user: it runs
            return True
        try:  # a zombie: dead, not yet reaped by its parent
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except (OSError, IndexError):
            return True


# The tokens of this process's saves under way (threads may save at once).
_SAVING: set[str] = set()


@contextlib.contextmanager
def saving(owner: Owner) -> Iterator[None]:
    """Marks `owner`'s save as under way in this process."""
    _SAVING.add(owner.token)
    try:
        yield
    finally:
        _SAVING.discard(owner.token)


def new_owner() -> Owner:
    """This save's owner: process 0's in every process (`claim.from_process`)."""
    owner = Owner(secrets.token_hex(4), os.getpid(), HOST)
    if jax.process_count() == 1:
        return owner
    text = from_process("owner", f"{owner.token}-{owner.pid}-{owner.host}")
    token, pid, host = text.split("-", 2)
    return Owner(token, int(pid), host)


def beside(target: epath.Path, owner: Owner, kind: str) -> epath.Path:
    """The directory of kind `NEW` or `OLD` that `owner` uses beside `target`."""
    return target.parent / (
        f"{_prefix(target)}{kind}-{owner.token}-{owner.pid}-{owner.host}"
    )


def _prefix(target: epath.Path) -> str:
    name = target.name
    if len(name.encode()) > _LONGEST_STEM:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = name.encode()[:80].decode(errors="ignore") + "~" + digest
    return f".{name}.oeqx-"


@dataclasses.dataclass(frozen=True)
class Leftover:
    """A directory beside a target, of kind `NEW` or `OLD`."""

    path: epath.Path
    kind: str
    owner: Owner


def leftovers(target: epath.Path) -> list[Leftover]:
    """The directories beside `target` that saves to it wrote, oldest first."""
    prefix = _prefix(target)
    try:
        names = os.listdir(os.fspath(target.parent))
    except OSError:
        return []
    found = []
    for name in names:
        match = name.startswith(prefix) and _FIELDS.fullmatch(name[len(prefix) :])
        if match:
            owner = Owner(match["token"], int(match["pid"]), match["host"])
            path = target.parent / name
            found.append(Leftover(path, match["kind"], owner))
    return sorted(found, key=lambda x: _changed(x.path))


def recover(target: epath.Path) -> epath.Path:
    """Renames back the `OLD` an interrupted swap left beside a missing
    `target` (after a live owner's moment to finish); returns where the
    checkpoint now is (the `OLD` one on a read-only file system)."""
    if is_remote(target) or os.path.lexists(os.fspath(target)):
        return target
    olds = [x for x in leftovers(target) if x.kind == OLD]
    if not olds:
        return target
    if any(x.owner.alive() is not False for x in olds):
        deadline = time.monotonic() + SWAP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if os.path.lexists(os.fspath(target)):
                return target
    old = olds[-1].path  # the one replaced last
    try:
        os.rename(os.fspath(old), os.fspath(target))
    except FileNotFoundError:  # its owner finished the swap after all
        return target
    except OSError:
        return target if os.path.lexists(os.fspath(target)) else old
    return target


def tidy(target: epath.Path) -> None:
    """`recover`s `target`, then deletes what dead owners left beside it."""
    if is_remote(target):
        return
    recover(target)
    for leftover in leftovers(target):
        if leftover.owner.alive() is False:
            remove(leftover.path)


def remove(path: epath.Path) -> None:
    """Deletes `path` and everything in it, if there."""
    shutil.rmtree(os.fspath(path), ignore_errors=True)


def _changed(path: epath.Path) -> float:
    try:
        return os.lstat(os.fspath(path)).st_ctime
    except OSError:
        return 0.0
