"""What a path names, whoever wrote its items: for `verify` and the command line.

An item is an orbax_eqx item (a sidecar), one saved through
`oeqx.type_handler_registry()` (groups of arrays with indexes and no sidecar,
read as one `TypedMetadata`), or a plain Orbax PyTree item (`plain`).
A step directory holds items and may hold others (a JSON item, a data
loader's state): those are listed with the handler Orbax recorded for them,
never read. A CheckpointManager root holds steps, directories named by
integers that hold items.
"""

import dataclasses
import os
from typing import Any

from etils import epath

from .._bytes.route import is_remote
from .._errors import CheckpointNotFoundError
from .._format import locate as _locate
from .._format.sidecar import FILE_NAME, Metadata
from .._format.sidecar_read import read as read_sidecar
from .._storage.typed.read import Group
from .._storage.typed.read import find as find_groups
from .._storage.typed.write import GROUP_PREFIX
from . import plain as _plain

ORBAX_EQX, TYPED, PLAIN = "orbax_eqx", "type handler", "plain Orbax"


@dataclasses.dataclass(frozen=True)
class TypedMetadata(Metadata):
    """Every group of a type-handler item as one `Metadata` (array leaves
    only), and the groups themselves (each file is named by its group)."""

    groups: tuple[Group, ...] = ()


@dataclasses.dataclass(frozen=True)
class OtherItem:
    """An item of a step that is none of ours and no plain Orbax PyTree: its
    name, directory and the handler Orbax recorded for it (None if none)."""

    name: str
    path: epath.Path
    handler: str | None


def _is_typed(path: epath.Path) -> bool:
    return any(
        p.name.startswith(GROUP_PREFIX) and (p / FILE_NAME).exists()
        for p in path.iterdir()
    )


def kind_of(path: epath.Path) -> str | None:
    """`ORBAX_EQX`, `TYPED` or `PLAIN` if `path` is an item of that kind."""
    try:
        if _locate.is_item(path):
            return ORBAX_EQX
        if _is_typed(path):
            return TYPED
        if _locate.is_plain_item(path):
            return PLAIN
    except OSError:
        return None
    return None


def metadata_kind(saved: Metadata) -> str:
    """`ORBAX_EQX`, `TYPED` or `PLAIN`: who wrote the item `saved` describes."""
    if isinstance(saved, _plain.PlainMetadata):
        return PLAIN
    return TYPED if isinstance(saved, TypedMetadata) else ORBAX_EQX


def _children(path: epath.Path) -> list[epath.Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except OSError:
        return []


def items_in(step: epath.Path) -> list[epath.Path]:
    """The items of every kind directly under `step`, by name."""
    return [p for p in _children(step) if kind_of(p) is not None]


def others_in(step: epath.Path) -> list[OtherItem]:
    """The directories of `step` that are no item of ours or plain Orbax's
    (nor Orbax's unfinished saves, `<name>.orbax-checkpoint-tmp-<n>`)."""
    handlers = _plain.handlers_in(step)
    return [
        OtherItem(p.name, p, handlers.get(p.name))
        for p in _children(step)
        if kind_of(p) is None and ".orbax-checkpoint-tmp" not in p.name
    ]


def steps_in(root: epath.Path) -> list[tuple[int, epath.Path]]:
    """A CheckpointManager root's finished steps that hold items, oldest first."""
    return sorted(
        (int(p.name), p) for p in _children(root) if p.name.isdigit() and items_in(p)
    )


def items_under(directory: str | os.PathLike) -> list[tuple[int | None, epath.Path]]:
    """Every item `directory` names, each with its step (None unless
    `directory` is a CheckpointManager root), oldest step first: an item is
    itself, a step gives its items, a root each item of each step. A path
    that names none raises what `find_item` raises (no such path, a file,
    no checkpoint...)."""
    path = _locate.as_path(directory)
    readable = is_remote(path) or os.access(path, os.R_OK | os.X_OK)
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
    return [(None, find_item(path))]


def find_item(directory: str | os.PathLike) -> epath.Path:
    """`locate.find_item`, or the one type-handler item `directory` names."""
    try:
        return _locate.find_item(directory)
    except CheckpointNotFoundError:
        path = _locate.as_path(directory)
        found = [path] if kind_of(path) == TYPED else []
        found = found or [p for p in _children(path) if kind_of(p) == TYPED]
        if len(found) != 1:
            raise  # none, or several: as for sidecar items
        return found[0]


def read(item: epath.Path) -> Metadata:
    """The item's `Metadata`: its sidecar, its type-handler groups' indexes
    as one `TypedMetadata`, or a plain Orbax item's `PlainMetadata`."""
    kind = kind_of(item)
    if kind == PLAIN:
        return _plain.read(item)
    if kind != TYPED:
        return read_sidecar(item)  # which says what is wrong, if anything
    groups: dict[str, Group] = {}
    for group in find_groups(item).values():
        groups.setdefault(group.saved.token, group)
    ordered = tuple(groups[k] for k in sorted(groups))
    leaves = {n: r for g in ordered for n, r in g.saved.leaves.items()}
    first = ordered[0].saved
    return TypedMetadata(
        directory=os.fspath(item),
        format_version=first.format_version,
        versions=first.versions,
        leaves=dict(sorted(leaves.items())),
        modules={},
        groups=ordered,
    )
