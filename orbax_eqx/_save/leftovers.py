"""The directories a standalone save writes beside its target, named by owner.

`oeqx.save(".../model", ...)` writes the new checkpoint beside the target and
swaps it in (see `replace`). Those directories are named after the target and
the save that owns them:

    .model.oeqx-new-<token>-<pid>-<host>      the new checkpoint
    .model.oeqx-new-<...>.orbax-checkpoint-tmp   Orbax writing it
    .model.oeqx-old-<token>-<pid>-<host>      the replaced one, being deleted

A save killed part way leaves them behind. A later save to the same target
deletes those of owners that are dead: on this host (by its name), with no
process of that pid, or saves of this very process that ended. It never
deletes a live save's, nor one from another host, whose liveness it cannot
see. If the target is missing and an `old` is there, a crash came between the
two renames of a swap: the `old` is renamed back (by a save or a restore). If
its owner still runs, it is mid-swap; it gets a moment to finish first
(`SWAP_WAIT_S`).
"""

import contextlib
import dataclasses
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

from .._bytes.paths import is_remote
from .claim import from_process

NEW, OLD = "new", "old"
ORBAX_TMP = ".orbax-checkpoint-tmp"  # what Orbax adds to a directory it writes
# How long a reader waits for a live save to finish a swap (two renames).
SWAP_WAIT_S = 2.0
# A name longer than this is shortened (with a hash) in the names beside it,
# so that they stay within the 255 bytes a file name may have.
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
    """Marks `owner`'s save as under way in this process: what it leaves
    beside its target is deleted by later saves only once the block ends."""
    _SAVING.add(owner.token)
    try:
        yield
    finally:
        _SAVING.discard(owner.token)


def new_owner() -> Owner:
    """This save's owner: process 0's, the same in every process of a
    multi-host run (every process calls this once per save, in the same order;
    shared through the coordinator's key-value store, see `claim.from_process`)."""
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
    """A directory beside a target: its path, kind (`NEW`, also for Orbax's
    temporary directory of one, or `OLD`) and owner."""

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
    """Puts back the checkpoint an interrupted swap left beside `target`.

    Only if `target` is missing and a replaced checkpoint (`OLD`) is beside
    it: it is renamed back, after a live owner's moment to finish its swap.

    **Returns:** where the checkpoint now is: `target`, or the `OLD` directory
    if it could not be renamed back (a read-only file system).
    """
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
    """Recovers `target` (see `recover`), then deletes the directories beside
    it whose owners are dead."""
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
