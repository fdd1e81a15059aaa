"""The library's exceptions, and how a list of problems becomes one message."""

import sys
import warnings
from collections.abc import Sequence
from typing import TypeVar

# Long lists of problems are cut here; the rest is counted, not printed.
MAX_LISTED = 20


class OrbaxEqxError(Exception):
    """Base class of every error raised by orbax_eqx.

    Errors made by `_errors.problem` also say, as fields, what the message
    says in words: `file` (the file or directory at fault, or None), `leaves`
    (the leaf names concerned, possibly none) and `remedy` (the fix offered,
    or None).
    """

    file: str | None = None
    leaves: tuple[str, ...] = ()
    remedy: str | None = None


class UnsupportedLeafError(OrbaxEqxError, TypeError):
    """A leaf of the item cannot be recorded without pickle."""


class CheckpointMismatchError(OrbaxEqxError, ValueError):
    """The skeleton does not match what the checkpoint holds."""


class RebuildError(OrbaxEqxError, ValueError):
    """A checkpoint cannot be rebuilt without a skeleton under the given `allow`.

    `problems` lists `(leaf path, what is wrong)`; `needed` the modules that
    `allow` lacks.
    """

    def __init__(self, message: str, problems=(), needed=()):
        super().__init__(message)
        self.problems = list(problems)
        self.needed = list(needed)


class ShardingRuleError(CheckpointMismatchError):
    """Sharding rules that do not fit the mesh, or a leaf they cannot place.

    `problems` names each offending rule or leaf; `fix` says what to change.
    """

    def __init__(self, problems: Sequence[str], fix: str):
        self.problems = list(problems)
        self.fix = fix
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = "Sharding rules cannot place these leaves:\n" + bullet_list(
                self.problems
            )
        super().__init__(f"{text}\n{fix}")


class HostLocalArrayError(UnsupportedLeafError, ValueError):
    """A multi-host save holds an array that lives on one process only."""


class CheckpointNotFoundError(OrbaxEqxError, FileNotFoundError):
    """A path holds no orbax_eqx checkpoint."""


class CheckpointDamagedError(OrbaxEqxError, ValueError):
    """A checkpoint's files are missing, cut short, changed or not of this
    format: its sidecar, a pack, a shard index or Orbax's array store."""


class SidecarError(CheckpointDamagedError):
    """The sidecar file of a checkpoint is missing, damaged or of unknown format."""


class BridgeError(OrbaxEqxError, ValueError):
    """The state_dict bridge cannot do what it was asked: a mapping that does
    not fit the tree or the tensors, a malformed mapping or rename, a damaged
    safetensors file, an export that cannot be written.

    The message lists every problem at once, each naming the tensor and the
    leaf, then the fixes that would work.
    """


class CheckpointPermissionError(OrbaxEqxError, PermissionError):
    """A checkpoint's directory or files cannot be read by this user."""


# Remedies that many errors offer, worded once.
EARLIER_STEP = "Restore an earlier step, or re-save the checkpoint."
FALL_BACK = (
    "Restore an earlier step (`oeqx.restore_latest` falls back past damaged "
    "steps); `python -m orbax_eqx verify PATH` checks every leaf."
)

_E = TypeVar("_E", bound=OrbaxEqxError)


def problem(
    cls: type[_E],
    what: str,
    *,
    file: object = None,
    leaves: Sequence[str] = (),
    remedy: str | None = None,
) -> _E:
    """An error of class `cls`: `what` went wrong (naming the leaf or file
    first), then the `remedy`; `file`, `leaves` and `remedy` are kept as its
    fields too."""
    error = cls(what if remedy is None else f"{what} {remedy}")
    error.file = None if file is None else str(file)
    error.leaves = tuple(leaves)
    error.remedy = remedy
    return error


def first_line(error: BaseException, empty: str | None = None) -> str:
    """The first line of `error`'s message: `empty` (default: the error's class
    name) if it has none, or if it cannot be made (an int too long, say)."""
    try:
        text = str(error)
    except Exception:
        text = ""
    lines = text.strip().splitlines()
    if lines:
        return lines[0]
    return type(error).__name__ if empty is None else empty


def permission_denied(path: object) -> CheckpointPermissionError:
    """The error for a checkpoint path that this process may not read."""
    return CheckpointPermissionError(
        f"Permission denied: {path} cannot be read by this user. Check the "
        "permissions of the checkpoint's directory and files (`ls -l`), or run as "
        "the user that saved it."
    )


def bullet_list(problems: Sequence[str], limit: int = MAX_LISTED) -> str:
    """Formats problems as an indented bullet list, capped at `limit` entries."""
    lines = [f"  - {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more.")
    return "\n".join(lines)


def inline_list(problems: Sequence[str], limit: int = 3) -> str:
    """Problems on one line, separated by `; `, capped at `limit` entries.

    For command-line errors, which are one line each.
    """
    text = "; ".join(problems[:limit])
    if len(problems) > limit:
        text += f"; and {len(problems) - limit} more"
    return text


def some(items: Sequence[object], limit: int = 3, sep: str = ", ") -> str:
    """The first `limit` of `items` joined by `sep`, then " and N more" if there
    are more: for a list inside a sentence."""
    text = sep.join(str(x) for x in items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more"
    return text


class ObjectStoreError(OrbaxEqxError, OSError):
    """A request to an object store (`gs://`, `s3://`) failed after its
    retries, or stalled: the message names the file, the bucket and endpoint,
    and the store's answer, and what to set where settings can help (refused
    credentials, an endpoint where nothing answers). A failing store is never
    taken for a damaged checkpoint: `restore_latest` raises this rather than
    falling back to an older step."""


class ObjectStoreSaveError(ObjectStoreError, ValueError):
    """A save that cannot succeed on its object store (a rename commit or
    `pack=False` on `s3://`), refused before anything is written."""


class OrbaxEqxWarning(UserWarning):
    """Base class of every warning orbax_eqx gives: static fields that differ
    where the user chose to go on, a fallback to an older step, skeleton
    leaves kept by a partial restore."""


# Modules whose frames stand between the user's line and a warning: ours, and
# Orbax's (a `CheckpointManager` calls the handler through several of its own).
_LIBRARY_PREFIXES = ("orbax_eqx.", "orbax.")


def warn_user(message: str, category: type[Warning]) -> None:
    """Warns with `category`, pointing at the first line outside orbax_eqx and
    Orbax: the user's `oeqx.restore(...)` or `mngr.restore(...)`, however many
    of our or Orbax's frames lie between.

    Where no such frame exists (a restore run by a thread of Orbax's), the
    outermost frame is named.
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _is_library(frame):
        frame = frame.f_back
        level += 1
    # +1: `warnings.warn` counts from this function's frame.
    warnings.warn(message, category, stacklevel=level + 1)


def _is_library(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return (name + ".").startswith(_LIBRARY_PREFIXES)
