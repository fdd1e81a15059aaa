"""Leaf names: from a leaf's key path to its readable on-disk name and storage key."""

import hashlib
import re
from typing import Any

import jax.tree_util as jtu

ESCAPE = "\\"
SEPARATOR = "."
MAX_STORAGE_KEY = 120

_INT_LIKE = re.compile(r"-?[0-9]+")
_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9_.\-]")
# What Orbax and TensorStore name their own files and directories beside the
# stored arrays (orbax-checkpoint 0.12: `PYTREE_METADATA_FILE`, the sharding
# file, the array metadata store, the legacy msgpack `checkpoint`, OCDBT's
# manifest, data and per-process directories, the step's metadata and commit
# files, TensorStore's lock files), and our sidecar. With `use_ocdbt=False`
# each stored array is a directory named by its storage key, so a leaf named
# `_METADATA` would meet Orbax's file of that name. Compared ignoring case, for
# file systems that do.
_ORBAX_FILES = frozenset(
    name.casefold()
    for name in (
        "_METADATA",
        "_sharding",
        "array_metadatas",
        "checkpoint",
        "manifest.ocdbt",
        "d",
        "descriptor",
        "_CHECKPOINT_METADATA",
        "_ROOT_METADATA",
        "metadata",
        "commit_success.txt",
        "zarr.json",
        "orbax_eqx.json",
    )
)
_ORBAX_PATTERNS = re.compile(
    r"ocdbt\.process_.*|.*\.__lock|.*\.orbax-checkpoint-tmp", re.IGNORECASE
)


def escape_part(text: str) -> str:
    """Escapes one free-form part (a dict key) so that `.` cannot split it."""
    escaped = text.replace(ESCAPE, ESCAPE * 2).replace(SEPARATOR, ESCAPE + SEPARATOR)
    # A string key "0" must not collide with the integer key 0 or a sequence
    # index; nor may the empty key vanish between two separators.
    if text == "" or _INT_LIKE.fullmatch(text):
        escaped = ESCAPE + escaped
    return escaped


def key_part(entry: Any) -> str:
    """The name part of one entry of a JAX key path."""
    # Exact types first: a walk asks this several times per leaf.
    kind = type(entry)
    if kind is jtu.GetAttrKey:
        return entry.name
    if kind is jtu.SequenceKey:
        return str(entry.idx)
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jtu.FlattenedIndexKey):
        return str(entry.key)
    if isinstance(entry, jtu.DictKey):
        key = entry.key
        if isinstance(key, str):
            return escape_part(key)
        if type(key) is int:
            return str(key)
        # Other hashables (tuples, enums, floats...): mark them so they cannot
        # collide with a string or integer key.
        return ESCAPE + "(" + escape_part(repr(key)) + ")"
    return ESCAPE + "(" + escape_part(str(entry)) + ")"


def join(parts: list[str] | tuple[str, ...]) -> str:
    return SEPARATOR.join(parts)


def storage_key(name: str) -> str:
    """The key Orbax stores a leaf under: the name, or a safe, short stand-in."""
    if (
        len(name) <= MAX_STORAGE_KEY
        and _SAFE_KEY.fullmatch(name)
        and not _is_orbax_file(name)
    ):
        return name
    return _stand_in(name)


def _is_orbax_file(name: str) -> bool:
    return name.casefold() in _ORBAX_FILES or bool(_ORBAX_PATTERNS.fullmatch(name))


def _stand_in(name: str) -> str:
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    # `~` never appears in a safe name, so stand-ins cannot collide with names,
    # nor with Orbax's files.
    prefix = _UNSAFE_CHAR.sub("_", name)[: MAX_STORAGE_KEY - 17]
    return f"{prefix}~{digest}"


# One part of a leaf path as `jax.tree_util.keystr` prints it: `.attr`, `[0]`,
# `['key']`.
_PATH_PART = re.compile(
    r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(-?[0-9]+)\]|\['((?:[^'\\]|\\.)*)'\]"
)


def label(name: str, path: str | None = None) -> str:
    """How a message names a leaf: by its leaf name (`` `model.layers.0.weight` ``,
    as `inspect` shows it), with its leaf path (`keystr`, if known) beside it
    only where the name cannot be read off the path: `` `\\0` (path `['0']`) ``."""
    # Text that is not valid Unicode (a lone surrogate) is shown escaped, as
    # `keystr` and `inspect` show it.
    name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    shown = f"`{name}`" if name else "`<root>`"
    if path is None or path == "<root>" or _plain_name(path) == name:
        return shown
    return f"{shown} (path `{path}`)"


def _plain_name(path: str) -> str | None:
    """The name a leaf path reads as, parts joined by `.` unescaped; None if
    the path has parts of other kinds."""
    parts, at = [], 0
    for match in _PATH_PART.finditer(path):
        if match.start() != at:
            return None
        parts.append(next(g for g in match.groups() if g is not None))
        at = match.end()
    return join(parts) if at == len(path) else None
