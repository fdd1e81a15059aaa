"""The files of a safetensors source (a file; a directory, through its
`model.safetensors.index.json` or, local only, every `.safetensors` in it; a
list of files), found and checked before any tensor is read. The index is
attacker input: read bounded, its `weight_map` naming allowed tensors and
plain file names beside it (`FILE_NAME`), each tensor in the file it says."""

import os
import posixpath
import re
from typing import Any

import msgspec

from ..._bytes import route as _route
from ..._bytes.route import is_remote
from ..._errors import inline_list, some
from .header import Header, SafetensorsError, name_problem, read_headers, where

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SUFFIX = ".safetensors"
# Far more than any index: a line of JSON per tensor.
MAX_INDEX_BYTES = 64 << 20
# Files one source may have: far more than any model's (hundreds at most).
MAX_FILES = 1 << 16
# What an index may name: a file beside it. Letters, digits, `._-`, not
# starting with a dot, ending in `.safetensors`.
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.safetensors")

Source = str | os.PathLike | list[str | os.PathLike] | tuple[str | os.PathLike, ...]


class SourceError(SafetensorsError):
    """A safetensors source that is missing, or whose files do not agree."""


def find(source: Source) -> list[Header]:
    """The checked headers of every file of `source`, in file-name order."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise SourceError(
                "The list of safetensors files is empty. Give a file, a "
                "directory, or a non-empty list of files."
            )
        if len(source) > MAX_FILES:
            raise SourceError(
                f"The list of safetensors files has {len(source)} files, more "
                f"than the {MAX_FILES} a source may have."
            )
        return _checked(read_headers([where(p) for p in source]))
    path = where(source)
    if is_remote(path):
        return _remote(path.rstrip("/"))
    if os.path.lexists(path) and not os.path.isdir(path):
        return [read_headers([path])[0]]  # which refuses a FIFO, a device...
    if not os.path.isdir(path):
        raise SourceError(f"{path} does not exist.")
    index = os.path.join(path, INDEX_FILE)
    if os.path.lexists(index):  # a FIFO or a link there too: refused, not skipped
        return _indexed(path, index, os.path.join)
    names = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX))
    if not names:
        raise SourceError(f"{path} holds no .safetensors file.")
    return _checked(read_headers([os.path.join(path, n) for n in names]))


def _remote(url: str) -> list[Header]:
    if url.endswith(SUFFIX):
        return read_headers([url])
    store = _route.for_path(url)
    index = posixpath.join(url, INDEX_FILE)
    if store.exists(index):
        return _indexed(url, index, posixpath.join)
    single = posixpath.join(url, SINGLE_FILE)
    if store.exists(single):
        return read_headers([single])
    raise SourceError(
        f"{url} holds neither {INDEX_FILE} nor {SINGLE_FILE} (an object store "
        "is not listed for other files). Give the URL of a .safetensors file, "
        "or a list of them."
    )


def _indexed(directory: str, index: str, join) -> list[Header]:
    weight_map = read_index(index)
    names = sorted(set(weight_map.values()))
    if len(names) > MAX_FILES:
        raise SourceError(
            f"{index} names {len(names)} files, more than the {MAX_FILES} a "
            "source may have. Re-download or re-export the directory."
        )
    store = _route.for_path(index)
    gone = []
    for n in names:  # a few missing say enough: no request for every name
        if not store.exists(join(directory, n)):
            gone.append(n)
            if len(gone) > 3:
                break
    if gone:
        raise SourceError(
            f"{index} names files that are not there: {', '.join(gone[:3])}"
            + (" and more" if len(gone) > 3 else "")
            + ". Re-download or re-export the directory."
        )
    headers = _checked(read_headers([join(directory, n) for n in names]))
    found = {name: h.path for h in headers for name in h.tensors}
    wrong = [
        f"`{t}` is in {found.get(t, 'no file')}, not {n}"
        for t, n in weight_map.items()
        if posixpath.basename(found.get(t, "").replace(os.sep, "/")) != n
    ]
    if wrong:
        raise SourceError(
            f"{index} does not match its files: {inline_list(wrong)}. "
            "Re-download or re-export the directory."
        )
    return headers


def read_index(index: str) -> dict[str, str]:
    """The index's `weight_map`, checked: tensor names allowed, file names
    `FILE_NAME` (files beside the index)."""

    def refused(what: str) -> SourceError:
        return SourceError(
            f"{index} is not a safetensors index: it {what}. Re-download or "
            "re-export the directory."
        )

    try:
        data = _route.read_bounded(index, MAX_INDEX_BYTES, refused)
    except FileNotFoundError:  # a dangling link, or gone since
        raise refused("is a link to nothing, or was removed") from None
    try:
        weight_map = msgspec.json.decode(data, type=_Index).weight_map
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        UnicodeDecodeError,
        RecursionError,
    ) as e:
        raise SourceError(
            f"{index} is not a safetensors index (no valid weight_map: {e})."
        ) from None
    problems = []
    for tensor, file in weight_map.items():
        problem = name_problem(tensor)
        if problem is not None:
            problems.append(f"the tensor name {repr(tensor)[:80]} {problem}")
        elif not (isinstance(file, str) and FILE_NAME.fullmatch(file)):
            problems.append(f"`{tensor}` is in {_file_shown(file)}")
    if problems:
        raise SourceError(
            f"{index} names what an index may not: {inline_list(problems)}. An "
            "index names tensors, and files beside it by plain names "
            "(model-00001-of-00002.safetensors: no `/`, no `..`, no URL). "
            "Re-download the directory from a source you trust."
        )
    return weight_map


class _Index(msgspec.Struct):
    """An index, as far as a reader needs it: its `weight_map`, each entry
    then checked on its own (`read_index`); other keys (`metadata`) ignored."""

    weight_map: dict[str, Any]


def _file_shown(file: Any) -> str:
    if isinstance(file, str):
        return repr(file[:80]) + (", not a file beside the index" if file else "")
    return f"{type(file).__name__} {repr(file)[:40]}, not a file name"


def _checked(headers: list[Header]) -> list[Header]:
    """Refuses a tensor held by two files of one source."""
    seen: dict[str, str] = {}
    for h in headers:
        for name in h.tensors:
            if name in seen:
                raise SourceError(
                    f"Tensor `{name}` is in both {seen[name]} and {h.path}; "
                    "import one of them, or remove the duplicate."
                )
            seen[name] = h.path
    return headers


def describe(source: Source) -> str:
    """How messages name a source."""
    if isinstance(source, (list, tuple)):
        return some([where(s) for s in source], 1) if source else "(none)"
    return where(source)
