"""Leaf names: from a leaf's key path to its readable on-disk name and storage key.

A *leaf name* joins the parts of a key path with `.`: `layers.0.attn.weight`.
Dict keys that contain `.` or `\\` are escaped, and string keys that would read
like an integer key are marked, so that two different paths never share a name.

A *storage key* is what Orbax stores the array under. It is the leaf name
itself when that name is short and made of safe characters, which is almost
always; otherwise it is a sanitised prefix plus a hash of the full name.
"""

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
    if len(name) <= MAX_STORAGE_KEY and _SAFE_KEY.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    # `~` never appears in a safe name, so stand-ins cannot collide with names.
    prefix = _UNSAFE_CHAR.sub("_", name)[: MAX_STORAGE_KEY - 17]
    return f"{prefix}~{digest}"
