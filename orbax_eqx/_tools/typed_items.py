"""Checkpoints written through `oeqx.type_handler_registry()`, for the tools.

Orbax's own `PyTreeCheckpointHandler` writes such an item: its jax arrays are
in groups (`orbax_eqx~typed.<group>/`, each with an index; see
`_storage/typed.py`), everything else in Orbax's own files, and there is no
sidecar. `inspect` and `verify` find these items where they find sidecar
items (an item, a step's items, a CheckpointManager root's steps), and read
the groups' indexes in place of a sidecar.
"""

import dataclasses
import os
from typing import Any

from etils import epath

from .._errors import CheckpointNotFoundError
from .._format import locate as _locate
from .._format.sidecar import FILE_NAME, Metadata
from .._format.sidecar_read import read as read_sidecar
from .._storage.typed.read import Group
from .._storage.typed.read import find as find_groups
from .._storage.typed.write import GROUP_PREFIX


@dataclasses.dataclass(frozen=True)
class TypedMetadata(Metadata):
    """Every group of a type-handler item as one `Metadata` (array leaves
    only), and the groups themselves (each file is named by its group)."""

    groups: tuple[Group, ...] = ()


def is_typed_item(path: epath.Path) -> bool:
    """Whether `path` holds a group of arrays saved through the type handler."""
    try:
        return any(
            p.name.startswith(GROUP_PREFIX) and (p / FILE_NAME).exists()
            for p in path.iterdir()
        )
    except OSError:
        return False


def items_under(directory: str | os.PathLike) -> list[tuple[int | None, epath.Path]]:
    """`locate.items_under`, finding type-handler items where it finds none."""
    try:
        return _locate.items_under(directory)
    except CheckpointNotFoundError:
        found = typed_items(_locate.as_path(directory))
        if not found:
            raise
        return found


def find_item(directory: str | os.PathLike) -> epath.Path:
    """`locate.find_item`, or the one type-handler item `directory` names."""
    try:
        return _locate.find_item(directory)
    except CheckpointNotFoundError:
        found = typed_items(_locate.as_path(directory))
        if len(found) != 1 or found[0][0] is not None:
            raise  # none, several, or a manager root: as for sidecar items
        return found[0][1]


def typed_items(path: epath.Path) -> list[tuple[int | None, epath.Path]]:
    """The type-handler items `path` names, each with its step (None when
    `path` is no CheckpointManager root), oldest step first."""
    try:
        if not path.is_dir():
            return []
        if is_typed_item(path):
            return [(None, path)]
        children = sorted(p for p in path.iterdir() if p.is_dir())
    except OSError:
        return []
    items: list[tuple[int | None, Any]] = [
        (None, p) for p in children if is_typed_item(p)
    ]
    if items:
        return items
    found = []
    for step in children:
        if step.name.isdigit():  # a finished step: Orbax renamed it so
            found += [(int(step.name), p) for _, p in typed_items_in(step)]
    return sorted(found, key=lambda x: (x[0], x[1].name))


def typed_items_in(step: epath.Path) -> list[tuple[None, epath.Path]]:
    try:
        return [(None, p) for p in sorted(step.iterdir()) if is_typed_item(p)]
    except OSError:
        return []


def read(item: epath.Path) -> Metadata:
    """The item's sidecar, or its groups' indexes as one `TypedMetadata`."""
    if _locate.is_item(item) or not is_typed_item(item):
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
