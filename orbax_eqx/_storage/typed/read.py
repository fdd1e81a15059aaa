"""Typed groups, read: a group's sidecar checked, and its leaves read back."""

import dataclasses
import json
from typing import Any

from etils import epath

from ..._bytes import route as _route
from ..._errors import CheckpointDamagedError, SidecarError, permission_denied
from ..._format.sidecar import (
    EMPTY,
    FILE_NAME,
    MAX_BYTES,
    PACKED,
    SHARDS,
    LeafMetadata,
    Metadata,
)
from ..._format.sidecar_read import read as read_sidecar
from ..._tree.walk import (
    ARRAY,
)
from .. import read as _read
from .write import GROUP_DIR, GROUP_PREFIX, SEAL_FILE, SEAL_PREFIX, group_of, seal


@dataclasses.dataclass(frozen=True)
class Group:
    """One group as read back: its directory, and `Metadata` for the readers."""

    directory: epath.Path
    saved: Metadata  # leaves as `LeafMetadata`, the pack, the shard packs
    shardings: dict[str, Any]  # leaf name -> the stored sharding JSON


def find(directory: epath.Path) -> dict[str, Group]:
    """Every leaf of every group in item directory `directory`: `{name: Group}`."""
    directory = epath.Path(directory)
    try:
        names = [p.name for p in directory.iterdir()]
        entries = sorted(n for n in names if n.startswith(GROUP_PREFIX))
        seals = sorted(n for n in names if n.startswith(SEAL_PREFIX))
    except PermissionError:
        raise permission_denied(directory) from None
    found: dict[str, Group] = {}
    groups = {entry[len(GROUP_PREFIX) :] for entry in entries}
    for entry in seals:
        group = entry[len(SEAL_PREFIX) :]
        if group not in groups:
            raise CheckpointDamagedError(
                f"The arrays saved with orbax_eqx's type handler in {directory} "
                f"are incomplete: the directory {GROUP_DIR.format(group=group)} "
                f"that {entry} seals is missing (deleted, or never copied). "
                "Restore an earlier step, or re-save this one."
            )
    for entry in entries:
        group = _read_group(directory / entry)
        for name in group.saved.leaves:
            if name in found:
                raise _damaged(
                    group.directory / FILE_NAME,
                    f"leaf `{name}` is also in {found[name].directory.name}",
                )
            found[name] = group
    return found


def _read_group(where: epath.Path) -> Group:
    path = where / FILE_NAME
    group = where.name[len(GROUP_PREFIX) :]
    if not path.exists():
        raise _damaged(path, "it is missing")
    try:
        saved = read_sidecar(where, nodes=False)
    except SidecarError as e:
        raise CheckpointDamagedError(str(e)) from None
    if saved.token != group:
        raise _damaged(path, f"it names the group {saved.token!r}, not {group!r}")
    if group_of(list(saved.leaves)) != group:
        raise _damaged(path, "its leaves are not those its group was named for")
    shardings: dict[str, Any] = {}
    for name, record in saved.leaves.items():
        if record.kind != ARRAY or record.data not in (PACKED, SHARDS, EMPTY):
            raise _damaged(path, f"leaf `{name}` is no array of a pack or shard pack")
        shardings[name] = _sharding(path, name, record)
    _check_seal(where, group)
    return Group(where, saved, shardings)


def _sharding(path: epath.Path, name: str, record: LeafMetadata) -> Any:
    """The Orbax sharding metadata a leaf's record holds as JSON text, or None."""
    if record.sharding is None:
        return None
    try:
        found = json.loads(record.sharding)
    except (ValueError, RecursionError):
        found = None
    if not isinstance(found, dict):
        raise _damaged(path, f"leaf `{name}` has the sharding {record.sharding[:60]!r}")
    return found


def _check_seal(where: epath.Path, group: str) -> None:
    """The seal beside the group's directory must hold its sidecar's SHA-256:
    else the directory is another checkpoint's (or its sidecar was edited)."""
    path = where.parent / SEAL_FILE.format(group=group)
    problem = None
    try:
        found = _route.read_bounded(path, 1024, lambda what: _damaged(path, what))
        data = _route.read_bounded(where / FILE_NAME, MAX_BYTES)
    except FileNotFoundError:
        problem = (
            f"{path.name} beside it, which binds it to this checkpoint, is missing"
        )
    except PermissionError:
        raise permission_denied(path) from None
    else:
        if found != seal(data).encode("ascii"):
            problem = (
                f"its sidecar is not the one {path.name} beside it was sealed "
                "with: the directory was copied in from another checkpoint, or "
                "its sidecar was edited"
            )
    if problem is not None:
        raise CheckpointDamagedError(
            f"The arrays saved with orbax_eqx's type handler in {where} do not "
            f"belong to the checkpoint in {where.parent}: {problem}. Restore an "
            "earlier step, or re-save this one (never copy a group directory "
            "between checkpoints)."
        )


def _damaged(path: epath.Path, what: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"The sidecar {path} of arrays saved with orbax_eqx's type handler is "
        f"damaged: {what}. Restore an earlier step, or re-save this one."
    )


Request = _read.Request  # one array to read


def read(group: Group, requests: dict[str, Request], *, verify: bool = True):
    """Reads the requested leaves of one group: `{name: Request}` to arrays."""
    try:
        return _read.read(group.directory, group.saved, requests, verify=verify)
    except CheckpointDamagedError as e:
        # Their fixes name `verify`, which reads checkpoints with a sidecar only.
        raise CheckpointDamagedError(f"{e} {_NO_VERIFY}") from None


_NO_VERIFY = (
    "(Saved through `oeqx.type_handler_registry()`, this checkpoint has no "
    "sidecar, so `verify` cannot read it; a restore checks every byte it reads.)"
)
