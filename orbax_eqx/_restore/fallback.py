"""Restoring "the latest" when the newest steps are damaged, or deleted meanwhile.

Only damage moves it to an older step. A store that fails (throttling that
outlasts the retries, 5xx answers, a stall, a dropped connection: see
`_bytes/verdict.py`) is raised at once as an `ObjectStoreError`: the older
steps live on the same store, and a healthy newest step must not be passed
over because a request failed.
"""

from typing import Any, NamedTuple

import orbax.checkpoint as ocp

from .._bytes import damage as _damage
from .._errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ObjectStoreError,
    OrbaxEqxWarning,
    RebuildError,
    bullet_list,
    first_line,
    warn_user,
)
from .vanished import CheckpointDeletedError, CheckpointReplacedError

# Steps deleted under a restore that are followed by a new listing, at most: a
# manager that deletes steps faster than they can be read would otherwise keep
# this going forever. After that, the steps listed last are tried in turn.
MAX_DELETED = 10


class FallbackWarning(OrbaxEqxWarning):
    """Newer steps could not be restored; an older one was used."""


class RestoredStep(NamedTuple):
    step: int
    item: Any


def restore_latest(manager: ocp.CheckpointManager, args: Any = None) -> RestoredStep:
    """Restores the newest step that restores cleanly, trying older ones in turn.

    A step whose files were deleted, truncated or corrupted after it was saved
    raises when restored; this skips it, warns with a `FallbackWarning` that
    names it and why, and tries the next older step. A step that a manager
    deletes while it is being restored (`max_to_keep`, perhaps in another
    process) is no damage: the manager's list of steps is read again
    (`manager.reload()`) and the newest step now there is restored. A skeleton
    that does not match (`CheckpointMismatchError`) is the caller's to fix,
    and a store that fails (`ObjectStoreError`: its requests failed after
    their retries) is no damage of the step, so both are raised at once
    rather than skipped.

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
    steps = list(manager.all_steps())
    failures: list[str] = []  # of damaged steps, for the warning
    damaged: set[int] = set()
    deleted: list[int] = []
    replaced = 0
    while True:
        left = sorted(set(steps) - damaged, reverse=True)
        if not left:
            break
        step = left[0]
        try:
            item = manager.restore(step, args=args)
        except (CheckpointMismatchError, RebuildError):  # the caller's to fix
            raise
        except ObjectStoreError:  # the store failed, not the step
            raise
        except CheckpointReplacedError:
            # Saved anew under this restore (twice: the handler retried once).
            # Not damage: read it again, a few times at most.
            replaced += 1
            if replaced <= MAX_DELETED:
                continue
            raise
        except Exception as e:  # any damage: missing, truncated, unreadable
            failure = _damage.store_failure(e, manager.directory)
            if failure is not None:  # raw, from Orbax's own calls to the store
                raise failure from e
            if len(deleted) < MAX_DELETED:
                steps = _reread(manager, steps)
                if step not in steps or isinstance(e, CheckpointDeletedError):
                    deleted.append(step)  # not damage: gone; try what is there now
                    steps = [s for s in steps if s != step]  # (if half deleted)
                    continue
            failures.append(
                f"step {step}: {type(e).__name__}: {first_line(e, '(no message)')}"
            )
            damaged.add(step)
            continue
        if failures:
            warn_user(
                f"Restored step {step} of {manager.directory}, because newer steps "
                "could not be restored:\n" + bullet_list(failures),
                FallbackWarning,
            )
        return RestoredStep(step, item)
    raise _none_restored(manager.directory, failures, deleted)


def _none_restored(directory, failures: list[str], deleted: list[int]):
    """The error for a root none of whose steps restored: none there, or each
    damaged (`failures`), or deleted as fast as read (`deleted`)."""
    if not failures:
        gone = ""
        if deleted:
            were = "was" if len(deleted) == 1 else "were"
            gone = f" ({_steps(deleted)} {were} deleted meanwhile)"
        return CheckpointNotFoundError(
            f"{directory} holds no finished step to restore{gone}."
        )
    why = "The checkpoints are damaged; check the storage, or start afresh."
    if len(deleted) >= MAX_DELETED:
        why = (
            f"Steps were deleted as fast as they were read ({_steps(deleted)} "
            "first): restore while the manager that saves is idle, or have it keep "
            "more steps (`max_to_keep`)."
        )
    return CheckpointNotFoundError(
        f"No step of {directory} could be restored:\n"
        + bullet_list(failures)
        + f"\n{why}"
    )


def _reread(manager: ocp.CheckpointManager, steps: list[int]) -> list[int]:
    """The manager's steps, read from storage again (its cache may be stale)."""
    try:
        manager.reload()
    except Exception:  # a step deleted while it was listed: once more
        try:
            manager.reload()
        except Exception:
            return steps
    return list(manager.all_steps())


def _steps(steps: list[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))
