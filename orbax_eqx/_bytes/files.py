"""Opening local files safely: read bounded, created never through a link."""

import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any

from .._errors import OrbaxEqxError

ErrorFor = Callable[[str], Exception]

# A new file's random name: `{final}.tmp-{16 hex digits}`; tries if taken.
_NEW_NAME_TRIES = 8

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


class FileCheckError(OrbaxEqxError, OSError):
    """A file that is not a regular file, or not of the size expected."""


def kind(mode: int) -> str:
    """What a file of `stat` mode `mode` is, for messages: "a directory"..."""
    for test, text in _KINDS:
        if test(mode):
            return text
    return "not a regular file"


def not_regular(mode: int) -> str:
    """The `what` of an error for a file of mode `mode` that is not regular."""
    return f"is {kind(mode)}, not a regular file"


def default_error(path: Any) -> ErrorFor:
    return lambda what: FileCheckError(
        f"{os.fspath(path)} {what}. Replace it with the file that belongs there."
    )


def open_regular(
    path: Any, error: ErrorFor | None = None, *, follow: bool = True
) -> int:
    """Opens a local regular file for reading, never blocking on opening it."""
    error = error or default_error(path)
    text = os.fspath(path)
    # Before opening: opening a device can have effects of its own.
    mode = os.stat(text, follow_symlinks=follow).st_mode
    if not stat.S_ISREG(mode):
        raise error(not_regular(mode))
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(text, flags)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            # Replaced since the `stat`: a link (with O_NOFOLLOW), a socket...
            raise error(not_regular(os.lstat(text).st_mode)) from None
        raise
    try:
        # The descriptor's own file: whatever was swapped in after the `stat`.
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(not_regular(mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_size(fd: int, expected: int, error: ErrorFor) -> None:
    """Raises `error(...)` unless the open file `fd` has exactly `expected` bytes."""
    found = os.fstat(fd).st_size
    if found != expected:
        raise error(f"has {found} bytes where {expected} were written")


def read_bounded(path: Any, limit: int, error: ErrorFor | None = None) -> bytes:
    """A whole regular file (see `open_regular`) of at most `limit` bytes,
    checked before and while reading (in case it grows): more raises
    `error(...)`. Local paths only (`route.read_bounded` reads any)."""
    error = error or default_error(path)

    def too_big(found: str) -> Exception:
        return error(f"has {found} bytes, more than the {limit} allowed")

    fd = open_regular(path, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise too_big(str(size))
        parts, total = [], 0
        while True:
            part = os.read(fd, min(max(size - total, 0) + 1, limit + 1 - total))
            if not part:
                break
            parts.append(part)
            total += len(part)
            if total > limit:
                raise too_big("over " + str(limit))
        return b"".join(parts)
    finally:
        os.close(fd)


def create_new(final: Any) -> tuple[int, str]:
    """Creates a new, empty file `{final}.tmp-{random}` (`O_CREAT | O_EXCL |
    O_NOFOLLOW`, mode 0o666 less the umask) beside `final`, drawing another
    name if one is taken; returns `(descriptor for writing, its path)`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_NEW_NAME_TRIES):
        tmp = f"{os.fspath(final)}.tmp-{secrets.token_hex(8)}"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(
        errno.EEXIST,
        f"{_NEW_NAME_TRIES} random temporary names beside {os.fspath(final)} "
        "were all taken; remove the *.tmp-* files there",
    )


def replace_whole(final: Any, data: bytes) -> None:
    """Writes `data` as the local file `final`, whole or not at all: into a
    new file (`create_new`), fsync'd, renamed onto `final`; on any failure
    the new file is removed and `final` is as it was."""
    fd, tmp = create_new(final)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.fspath(final))
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
