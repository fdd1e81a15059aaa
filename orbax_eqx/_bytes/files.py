"""Opening files safely: checkpoint files read bounded, new files never through a link.

A plain `open` of a checkpoint file trusts whatever is at that path. A FIFO
there blocks the reader forever, a symlink to `/dev/zero` is read until memory
runs out, a directory reads as a few kilobytes of nothing. So a file is read
only if it is a regular file: it is opened with `O_NONBLOCK` (which cannot
block, not even on a FIFO with no writer) and checked with `fstat` on the
descriptor, the very file that will be read, before a byte is read; a device
is not even opened (a `stat` first refuses it). Reads are bounded by the size
the sidecar expects, or by a cap. New files are created with `O_EXCL |
O_NOFOLLOW` under a random name, so that a symlink planted at a predictable
name cannot redirect a write (`create_new`; `replace_whole` writes a file
whole that way and renames it into place).

Local files only: objects (`gs://...`) are read and written by `objects`.

Callers word the errors: each function takes `error`, which turns what is
wrong (`"is a FIFO (named pipe), not a regular file"`) into the exception to
raise, naming the file and the fix that fits. It imports nothing of ours but
`_errors`, so that every stage (the sidecar reader too) may use it.
"""

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
    """Opens a local regular file for reading, without ever blocking on opening it.

    **Arguments:**

    - `path`: a local path.
    - `error`: makes the exception for what is wrong with the file, given as
        "is a directory, not a regular file"; default: a `FileCheckError`
        naming the path.
    - `follow`: follow a symbolic link at `path` (to a regular file). False
        refuses the link itself.

    **Returns:** a descriptor in blocking mode, for `os.pread`/`os.fdopen`;
    the caller closes it. `FileNotFoundError` and `PermissionError` are raised
    as `os.open` raises them, for the caller to word.
    """
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
    """Reads a whole regular file of at most `limit` bytes.

    A file that is not regular (see `open_regular`), or holds more than
    `limit` bytes (checked before reading, and while reading, in case it
    grows), raises `error(...)`. Local paths only (`_bytes.route.read_bounded`
    reads any). `FileNotFoundError` and `PermissionError` are
    raised as opening raises them.
    """
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
    """Creates a new, empty file beside `final`, to be renamed onto it when written.

    The name is `{final}.tmp-{random}`, created with `O_CREAT | O_EXCL |
    O_NOFOLLOW`: a file or symbolic link already there (planted, or left by
    another writer) is never written through; another name is drawn. The
    mode is 0o666 less the umask, as `open(..., "w")` gives.

    **Returns:** `(descriptor for writing, its path)`; the caller closes the
    descriptor, and renames or removes the file.
    """
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
    """Writes `data` as the local file `final`, whole or not at all.

    The bytes go to a new file beside it (`create_new`: never through a link
    planted at a predictable name), are fsync'd, and the file is renamed onto
    `final`; on any failure the new file is removed and `final` is as it was.
    """
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
