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


class SidecarError(OrbaxEqxError, ValueError):
    """The sidecar file of a checkpoint is missing, damaged or of unknown format."""


class CheckpointNotFoundError(OrbaxEqxError, FileNotFoundError):
    """A path holds no orbax_eqx checkpoint."""


class CheckpointDamagedError(OrbaxEqxError, ValueError):
    """A checkpoint's array data is missing or shorter than its sidecar says."""


def bullet_list(problems: Sequence[str], limit: int = MAX_LISTED) -> str:
    """Formats problems as an indented bullet list, capped at `limit` entries."""
    lines = [f"  - {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more.")
    return "\n".join(lines)
