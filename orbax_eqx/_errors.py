"""The library's exceptions, and how a list of problems becomes one message."""

from collections.abc import Sequence

# Long lists of problems are cut here; the rest is counted, not printed.
MAX_LISTED = 20


class OrbaxEqxError(Exception):
    """Base class of every error raised by orbax_eqx."""


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


class SidecarError(OrbaxEqxError, ValueError):
    """The sidecar file of a checkpoint is missing, damaged or of unknown format."""


class ShardingRuleError(OrbaxEqxError, ValueError):
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


class HostLocalArrayError(OrbaxEqxError, ValueError):
    """A multi-host save holds an array that lives on one process only."""


class CheckpointNotFoundError(OrbaxEqxError, FileNotFoundError):
    """A path holds no orbax_eqx checkpoint."""


class CheckpointDamagedError(OrbaxEqxError, ValueError):
    """A checkpoint's array data is missing or shorter than its sidecar says."""


class CheckpointPermissionError(OrbaxEqxError, PermissionError):
    """A checkpoint's directory or files cannot be read by this user."""


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


class ObjectStoreError(OrbaxEqxError, OSError):
    """A request to an object store (`gs://`, `s3://`) failed after its
    retries, or stalled: the message names the file, the bucket and endpoint,
    and the store's answer, and what to set where settings can help (refused
    credentials, an endpoint where nothing answers). A failing store is never
    taken for a damaged checkpoint: `restore_latest` raises this rather than
    falling back to an older step."""


class ObjectStoreSaveError(OrbaxEqxError, ValueError):
    """A save that cannot succeed on its object store (a rename commit or
    `pack=False` on `s3://`), refused before anything is written."""
