"""What a path names for the tools, whoever wrote its items.

An item is an orbax_eqx item (a sidecar), one saved through
`oeqx.type_handler_registry()` (`typed_items`), or a plain Orbax PyTree item
(`plain_items`). A step directory holds items and may hold others (a JSON
item, a grain iterator's state...): those are listed by name with the
handler Orbax recorded for them, never read. A CheckpointManager root holds
steps, directories named by integers that hold items.
"""

import dataclasses
import os
from typing import Any

from etils import epath

from .._bytes.paths import is_remote
from .._format.locate import as_path, is_item
from . import plain_items as _plain
from . import typed_items as _typed

ORBAX_EQX, TYPED, PLAIN = "orbax_eqx", "type handler", "plain Orbax"


@dataclasses.dataclass(frozen=True)
class OtherItem:
    """An item of a step that is none of ours and no plain Orbax PyTree: its
    name, directory and the handler Orbax recorded for it (None if none)."""

    name: str
    path: epath.Path
    handler: str | None


def kind_of(path: epath.Path) -> str | None:
    """`ORBAX_EQX`, `TYPED` or `PLAIN` if `path` is an item of that kind."""
    try:
        if is_item(path):
            return ORBAX_EQX
        if _typed.is_typed_item(path):
            return TYPED
        if _plain.is_plain(path):
            return PLAIN
    except OSError:
        return None
    return None


def _children(path: epath.Path) -> list[epath.Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except OSError:
        return []


def items_in(step: epath.Path) -> list[epath.Path]:
    """The items of every kind directly under `step`, by name."""
    return [p for p in _children(step) if kind_of(p) is not None]


def others_in(step: epath.Path) -> list[OtherItem]:
    """The directories of `step` that are no item of ours or plain Orbax's."""
    handlers = _plain.handlers_in(step)
    return [
        OtherItem(p.name, p, handlers.get(p.name))
        for p in _children(step)
        if kind_of(p) is None and not _temporary(p.name)
    ]


def _temporary(name: str) -> bool:
    # Orbax's unfinished saves: `<name>.orbax-checkpoint-tmp-<n>`.
    return ".orbax-checkpoint-tmp" in name


def is_step(path: epath.Path) -> bool:
    """Whether `path` is a directory holding items (and is no item itself)."""
    return kind_of(path) is None and bool(items_in(path))


def steps_in(root: epath.Path) -> list[tuple[int, epath.Path]]:
    """A CheckpointManager root's finished steps that hold items, oldest first."""
    return sorted(
        (int(p.name), p) for p in _children(root) if p.name.isdigit() and items_in(p)
    )


def items_under(directory: str | os.PathLike) -> list[tuple[int | None, epath.Path]]:
    """Every item `directory` names, each with its step (None unless
    `directory` is a CheckpointManager root), oldest step first: an item is
    itself, a step gives its items, a root each item of each step. A path
    that names none raises what `typed_items.find_item` raises (no such path,
    a file, no checkpoint...)."""
    path = as_path(directory)
    remote = is_remote(path)
    readable = remote or os.access(path, os.R_OK | os.X_OK)
    if readable and path.is_dir():
        if kind_of(path) is not None:
            return [(None, path)]
        items = items_in(path)
        if items:
            return [(None, p) for p in items]
        found: list[tuple[int | None, Any]] = [
            (n, p) for n, step in steps_in(path) for p in items_in(step)
        ]
        if found:
            return found
    return [(None, _typed.find_item(path))]


def read(item: epath.Path):
    """The item's `Metadata`: its sidecar, its type-handler indexes, or for a
    plain Orbax item a `PlainMetadata` from Orbax's own metadata."""
    if kind_of(item) == PLAIN:
        return _plain.read(item)
    return _typed.read(item)
