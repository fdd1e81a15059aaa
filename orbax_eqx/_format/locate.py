"""Finds the item directory of a checkpoint from a path a user gives."""

import os

from etils import epath

from .._bytes.route import is_remote
from .._errors import CheckpointNotFoundError, permission_denied
from .sidecar import FILE_NAME

PLAIN_METADATA = "_METADATA"  # what Orbax's PyTree handlers write in an item


def as_path(directory: str | os.PathLike) -> epath.Path:
    """An absolute `epath.Path`; relative local paths are resolved here."""
    text = os.fspath(directory)
    if is_remote(text):
        return epath.Path(text)
    return epath.Path(os.path.abspath(text))


def is_item(path: epath.Path) -> bool:
    return (path / FILE_NAME).exists()


def is_plain_item(path: epath.Path) -> bool:
    """An item saved by Orbax's own PyTree handlers (no sidecar, Orbax's
    `_METADATA`): restored into a skeleton (`_orbax/plain.py`)."""
    return (path / PLAIN_METADATA).exists() and not is_item(path)


def items_in(path: epath.Path) -> list[epath.Path]:
    """The item directories in a step (not the type handler's groups, which
    hold sidecars of their own: `orbax_eqx~typed.<group>`)."""
    return sorted(
        p
        for p in path.iterdir()
        if p.is_dir() and not p.name.startswith("orbax_eqx~") and is_item(p)
    )


def steps_in(path: epath.Path) -> list[tuple[int, epath.Path]]:
    """Finished CheckpointManager steps (named by integers) under a root."""
    steps = []
    for p in path.iterdir():
        if p.is_dir() and p.name.isdigit() and items_in(p):
            steps.append((int(p.name), p))
    return sorted(steps)


def find_item(directory: str | os.PathLike) -> epath.Path:
    """The item directory at `directory`: itself, or the one item of a step."""
    path = as_path(directory)
    _check_directory(path)
    if is_item(path):
        return path
    items = items_in(path)
    if len(items) == 1:
        return items[0]
    if items:
        names = ", ".join(p.name for p in items)
        raise CheckpointNotFoundError(
            f"{path} holds several orbax_eqx items ({names}); pass one of them, "
            f"such as {items[0]}."
        )
    if is_plain_item(path):
        return path
    plain = [p for p in path.iterdir() if p.is_dir() and is_plain_item(p)]
    if len(plain) == 1:  # a step of a plain Orbax item
        return plain[0]
    steps = steps_in(path)
    if steps:
        numbers = ", ".join(str(s) for s, _ in steps[-10:])
        raise CheckpointNotFoundError(
            f"{path} is a CheckpointManager root (steps {numbers}), not a "
            f"checkpoint; pass a step directory such as {steps[-1][1]}."
        )
    raise CheckpointNotFoundError(
        f"{path} holds no orbax_eqx checkpoint (no {FILE_NAME} in it or in its "
        "subdirectories)."
    )


def _check_directory(path: epath.Path) -> None:
    """Raises unless `path` is a directory this process may read."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist.{_other_steps(path)}")
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is a file; pass the directory of a checkpoint."
        )
    if not is_remote(path) and not os.access(path, os.R_OK | os.X_OK):
        # Else the sidecar looks absent, and the error would say "no checkpoint".
        raise permission_denied(path)


def _other_steps(path: epath.Path) -> str:
    """For a missing step (`<root>/99` or `<root>/99/<item>`) of a manager root:
    the steps there are."""
    if is_remote(path):
        return ""
    root, rest = path.parent, tuple[str, ...]()
    if not root.exists():  # perhaps `<root>/99/<item>`
        root, rest = root.parent, (path.name,)
    try:
        steps = steps_in(root) if root.is_dir() else []
    except OSError:  # unreadable: then the error says no more than before
        return ""
    if not steps:
        return ""
    shown = "steps " + ", ".join(str(s) for s, _ in steps[-10:])
    if len(steps) > 10:
        shown = f"{len(steps)} steps, the newest {shown}"
    latest = steps[-1][1].joinpath(*rest)
    return (
        f" {root} holds {shown}; the latest is {steps[-1][0]}. Pass a step that "
        f"is there, such as {latest}."
    )
