"""Which store holds a path, and whole-file calls wherever the path is."""

import os
from typing import Any

from . import files as _files
from .store import ErrorFor, Store


def is_remote(path: Any) -> bool:
    """Whether `path` names an object (`gs://...`, `s3://...`), not a local file."""
    return "://" in os.fspath(path)


def for_path(path: Any) -> Store:
    """The store that holds `path`: local files, or objects of a bucket."""
    if is_remote(path):
        from . import objects  # TensorStore is only loaded for object stores

        return objects.store_for(os.fspath(path))
    from . import local

    return local.STORE


def read_bounded(path: Any, limit: int, error: ErrorFor | None = None) -> bytes:
    """A whole file of at most `limit` bytes, wherever it is (see
    `Store.read_whole`); `error` as for `files.read_bounded`."""
    return for_path(path).read_whole(path, limit, error or _files.default_error(path))


def write_new(path: Any, data: bytes) -> None:
    """Writes file `path` whole if there is none yet, wherever it is (see
    `Store.write_new`)."""
    for_path(path).write_new(path, data)


def write_whole(path: Any, data: bytes) -> None:
    """Writes file `path` whole or not at all, wherever it is (see
    `Store.write_whole`)."""
    for_path(path).write_whole(path, data)
