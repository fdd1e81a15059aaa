"""One save per step: two processes saving the same step never mix their files.

Orbax lets two saves of one step share `<step>.orbax-checkpoint-tmp` (the
later deletes and remakes it), so plain Orbax may commit a mix. Here every
save's token names each file it writes; the sidecar, naming the token, is
claimed (linked into place, failing if another is there); and a save checks,
before the sidecar and again before Orbax commits, that its directory (device
and inode) and every file it wrote are still there and nobody committed the
step. Files are what counts: a remade directory may get the old inode back.
The loser raises `ConcurrentSaveError` and removes its token's files.
"""

import dataclasses
import itertools
import os
import secrets
import shutil

import jax
import orbax.checkpoint as ocp
from etils import epath

from .._bytes import files as _files
from .._bytes import route as _route
from .._bytes.route import is_remote
from .._errors import OrbaxEqxError, some
from .._format.sidecar import (
    ARRAYS_DIR,
    FILE_NAME,
    MAX_BYTES,
    TOKEN,
    TOKEN_FILE_PREFIXES,
    arrays_dir,
)
from .._storage.orbax_store.keys import missing_in_store
from .futures import final_directory


class ConcurrentSaveError(OrbaxEqxError, RuntimeError):
    """Another process saved the same step into the same directory at once."""


@dataclasses.dataclass
class Started:
    """One save under way: its token and the directory it started in."""

    directory: epath.Path
    token: str
    # (st_dev, st_ino) once the writes start; None before, and when remote.
    identity: tuple[int, int] | None = None
    # {path: (st_dev, st_ino, st_size)} of its own files; None on object stores.
    written: dict[str, tuple[int, int, int] | None] = dataclasses.field(
        default_factory=dict
    )
    stored_keys: tuple[str, ...] = ()


def new_token() -> str:
    """16 random hex digits, process 0's in every process (`from_process`)."""
    return from_process("token", secrets.token_hex(8))


def from_process(kind: str, value: str, source: int = 0) -> str:
    """Process `source`'s `value`, in every process (each calls this once
    per save for each `kind`, in the same order). Through the distributed
    client's key-value store: no device collective to interleave with Orbax's.
    """
    if jax.process_count() == 1:
        return value
    key = f"orbax_eqx/{kind}/{next(_CALLS.setdefault(kind, itertools.count()))}"
    client = ocp.multihost.get_jax_distributed_client()
    if jax.process_index() == source:
        client.key_value_set(key, value)
        return value
    timeout_ms = ocp.multihost.coordination_timeout() * 1000
    return client.blocking_key_value_get(key, timeout_ms)


_CALLS: dict = {}  # per kind, this process's calls, numbered alike in every process


def begin(started: Started) -> None:
    """Records the directory as the writes start, once Orbax has made it."""
    started.identity = _identity(started.directory)


def before_sidecar(started: Started) -> None:
    """Raises if the directory was replaced or a file this save wrote is gone."""
    if started.identity is not None and _identity(started.directory) != (
        started.identity
    ):
        _lose(started, _REPLACED)
    gone = _gone_files(started)
    if gone:
        _lose(started, f"{_DELETED}; gone: {some(gone)}")


def explain(started: Started | None, error: BaseException) -> None:
    """Raises `ConcurrentSaveError` from `error` if another save took this one's
    directory away, which is then why a write failed; else returns."""
    if started is None:
        return
    now = _identity(started.directory)
    if now is None:
        return
    replaced = now == _MISSING or (
        started.identity is not None and now != started.identity
    )
    # The directory may have been replaced before `begin` noted it: the other
    # save's files, or this save's gone missing, are then the sign.
    missing = isinstance(error, FileNotFoundError) or any(
        sign in str(error) for sign in _MISSING_SIGNS
    )
    if replaced or _others(started) or missing:
        try:
            _lose(started, _REPLACED if replaced else _DELETED)
        except ConcurrentSaveError as lost:
            raise lost from error


def wrote(started: Started, path: epath.Path) -> None:
    """Notes a file this save wrote, for `before_commit` to find it unchanged
    (on an object store, with no inodes: still there)."""
    if started.identity is not None:
        st = os.stat(os.fspath(path))
        started.written[os.fspath(path)] = (st.st_dev, st.st_ino, st.st_size)
    elif is_remote(path):
        started.written[os.fspath(path)] = None


def claim_failed(started: Started) -> None:
    """The sidecar was there already: another save claimed the directory."""
    _lose(started, "the other save's sidecar was already in it")


def before_commit(started: Started) -> None:
    """Raises unless this save's files are still the step's, just before
    Orbax commits it; removes other saves' files."""
    before_sidecar(started)
    final = final_directory(started.directory)
    if final is not None and (final / FILE_NAME).exists():
        _lose(started, f"the other save committed the step first, at {final}")
    gone = _gone_arrays(started)
    if gone:
        _lose(started, f"{_DELETED}; gone: {some(gone)}")
    _remove_others(started)


def _gone_arrays(started: Started) -> list[str]:
    """The arrays this save gave Orbax's store that no longer read."""
    if started.identity is None or not started.stored_keys:
        return []
    arrays = arrays_dir(started.directory, started.token)
    missing = missing_in_store(arrays, started.stored_keys)
    return [f"array `{key}` in {arrays.name}" for key in missing]


def _gone_files(started: Started) -> list[str]:
    """The files this save wrote itself that are gone, or not as written."""
    gone = []
    for path, was in started.written.items():
        if was is None:  # an object: is it still there?
            name = os.path.basename(path)
            if not _route.for_path(path).exists(path) or (
                name == FILE_NAME and not _is_sidecar_of(path, started.token)
            ):
                gone.append(name)
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            gone.append(os.path.basename(path))
            continue
        name = os.path.basename(path)
        # A sidecar is also read: the other's may have got this one's inode
        # number, and have the same size.
        if (st.st_dev, st.st_ino, st.st_size) != was or (
            name == FILE_NAME and not _is_sidecar_of(path, started.token)
        ):
            gone.append(name)
    return gone


def _identity(path: epath.Path) -> tuple[int, int] | None:
    if is_remote(path):
        return None
    try:
        st = os.stat(os.fspath(path))
    except FileNotFoundError:
        return _MISSING
    return st.st_dev, st.st_ino


_MISSING = (-1, -1)


# How Orbax and TensorStore say that a file they wrote is gone.
_MISSING_SIGNS = ("NOT_FOUND", "No ArrayMetadata found", "params are missing")
_DELETED = (
    "files this save had written were deleted while it ran (Orbax deletes an "
    "unfinished temporary directory when a save of the same step starts)"
)
_REPLACED = (
    "its directory was deleted and made anew by the other save (Orbax does so "
    "when a save of a step starts while one is unfinished)"
)


def _lose(started: Started, what: str) -> None:
    remove(started.directory, started.token)
    _remove_written_objects(started)
    _remove_own_sidecar(started)
    where = started.directory
    raise ConcurrentSaveError(
        f"Another save of the same step ran into {where} at the same time: {what}. "
        f"This save (token {started.token}) stopped and removed its files, and "
        "is not committed; the other save's step is kept whole. Two jobs, or two "
        "CheckpointManagers, are saving to one checkpoint directory: give each "
        "its own."
    )


def remove(directory: epath.Path, token: str) -> None:
    """Removes the files of the save `token` from `directory`, if there."""
    if is_remote(directory):
        return
    shutil.rmtree(os.fspath(arrays_dir(directory, token)), ignore_errors=True)
    prefixes = tuple(prefix + token + "." for prefix in TOKEN_FILE_PREFIXES)
    for name in _names(directory):
        if name.startswith(prefixes):
            _unlink(directory / name)


def _remove_written_objects(started: Started) -> None:
    """On an object store, the objects this save wrote, but the sidecar."""
    for path in started.written:
        if is_remote(path) and os.path.basename(path) != FILE_NAME:
            _unlink(path)


def _remove_own_sidecar(started: Started) -> None:
    """Removes the sidecar if it names this save's token (not by inode: the
    other's may have this one's inode number)."""
    path = started.directory / FILE_NAME
    if os.fspath(path) in started.written and _is_sidecar_of(path, started.token):
        _unlink(path)


def _is_sidecar_of(sidecar: str | epath.Path, token: str) -> bool:
    """Whether `sidecar` names the save `token` near its start."""
    if is_remote(sidecar):
        try:
            head = _route.read_bounded(sidecar, MAX_BYTES)[: 1 << 16]
        except OSError:  # missing: not this save's
            return False
        return f'"token": "{token}"'.encode() in head
    try:
        # Not through a link, and never blocking: only our own file counts.
        fd = _files.open_regular(sidecar, follow=False)
    except OSError:  # missing, or not a regular file: not this save's
        return False
    try:
        return f'"token": "{token}"'.encode() in os.pread(fd, 1 << 16, 0)
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_others(started: Started) -> None:
    """Removes files of other saves' tokens: a losing save's leftovers."""
    if started.identity is not None:
        for token in _others(started):
            remove(started.directory, token)


def _others(started: Started) -> set[str]:
    """Tokens of other saves that have files in this save's directory."""
    arrays = ARRAYS_DIR.split("{token}")[0]
    found = set()
    for name in _names(started.directory):
        for prefix in (*TOKEN_FILE_PREFIXES, arrays):
            if name.startswith(prefix):
                token = name[len(prefix) :].split(".")[0]
                if TOKEN.fullmatch(token) and token != started.token:
                    found.add(token)
    return found


def _names(directory: epath.Path) -> list[str]:
    try:
        return os.listdir(os.fspath(directory))
    except OSError:
        return []


def _unlink(path: epath.Path | str) -> None:
    try:
        if is_remote(path):
            _route.for_path(path).delete(path)
        else:
            os.unlink(os.fspath(path))
    except OSError:
        pass
