"""Restoring "the latest" when the newest steps are damaged."""

import warnings
from typing import Any, NamedTuple

import orbax.checkpoint as ocp

from .._errors import CheckpointMismatchError, CheckpointNotFoundError, bullet_list


class FallbackWarning(UserWarning):
    """Newer steps could not be restored; an older one was used."""


class RestoredStep(NamedTuple):
    step: int
    item: Any


def restore_latest(manager: ocp.CheckpointManager, args: Any = None) -> RestoredStep:
    """Restores the newest step that restores cleanly, trying older ones in turn.

    A step whose files were deleted, truncated or corrupted after it was saved
    raises when restored; this skips it, warns with a `FallbackWarning` that
    names it and why, and tries the next older step. A skeleton that does not
    match (`CheckpointMismatchError`) is the caller's to fix, so it is raised
    at once rather than skipped.

    **Arguments:**

    - `manager`: an `ocp.CheckpointManager`.
    - `args`: what to pass to `manager.restore`, e.g. `oeqx.EqxRestore(skeleton)`
        or an `ocp.args.Composite(...)`.

    **Returns:** `RestoredStep(step, item)`: the step used and what it restored.

    !!! example

        ```python
        step, model = oeqx.restore_latest(mngr, oeqx.EqxRestore(skeleton))
        ```
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise CheckpointNotFoundError(
            f"{manager.directory} holds no finished step to restore."
        )
    failures = []
    for step in steps:
        try:
            item = manager.restore(step, args=args)
        except CheckpointMismatchError:
            raise
        except Exception as e:  # any damage: missing, truncated, unreadable
            failures.append(f"step {step}: {type(e).__name__}: {_first_line(e)}")
            continue
        if failures:
            warnings.warn(
                f"Restored step {step} of {manager.directory}, because newer steps "
                "could not be restored:\n" + bullet_list(failures),
                FallbackWarning,
                stacklevel=2,
            )
        return RestoredStep(step, item)
    raise CheckpointNotFoundError(
        f"No step of {manager.directory} could be restored:\n"
        + bullet_list(failures)
        + "\nThe checkpoints are damaged; check the storage, or start afresh."
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
