"""Restores on many processes end together: all with the arrays, or all with
one error.

A restore on one process can fail where the others succeed: a damaged chunk
that only its devices need, a file only it cannot open. If it raised alone,
the others would go on into Orbax's barriers (or JAX's shutdown) and wait
there for it forever. So every process, once its own part is done or has
failed, posts its outcome in the key-value store of JAX's distributed client
(the coordinator Orbax's barriers use; never a computation on a device, see
`_save/claim.py`), reads the others', and raises the first failure, by
process number, on every process, with the same message (a process that
failed waits only for those before it). A process that posts nothing within
Orbax's coordination timeout (it crashed, or was killed) is an error too:
the wait is bounded.
"""

import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from .. import _errors

T = TypeVar("T")
_CALLS = itertools.count()  # restores, numbered alike in every process
_OK = "ok"


class RestoreFailedElsewhereError(_errors.OrbaxEqxError, RuntimeError):
    """A process of a multi-process restore failed with an error that is not
    one of orbax_eqx's, or did not finish in time; every process raises it."""


def together(directory: Any, run: Callable[[], T]) -> T:
    """`run()`, this process's part of a restore of `directory`; with several
    processes, returns only if every process's part succeeded, else raises
    the same error on all of them (see the module's doc)."""
    if jax.process_count() == 1:
        return run()
    key = f"orbax_eqx/restore/{next(_CALLS)}"
    me, count = jax.process_index(), jax.process_count()
    error: Exception | None = None
    try:
        result = run()
    except Exception as e:
        error = e
    client = ocp.multihost.get_jax_distributed_client()
    mine = _OK if error is None else f"{type(error).__name__}\n{error}"
    client.key_value_set(f"{key}/{me}", mine)
    timeout_s = ocp.multihost.coordination_timeout()
    deadline = time.monotonic() + timeout_s
    # The first failure by process number wins: a process that failed waits
    # only for those before it, and one that succeeded for every other.
    for process in range(count if error is None else me + 1):
        if process == me:
            outcome = mine
        else:
            left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                outcome = client.blocking_key_value_get(f"{key}/{process}", left_ms)
            except Exception:  # the timeout, or the coordinator gone
                outcome = None
        if outcome == _OK:
            continue
        raise _error(directory, process, count, outcome, timeout_s) from error
    return result


def _error(directory, process: int, count: int, outcome, timeout_s) -> Exception:
    if outcome is None:
        return RestoreFailedElsewhereError(
            f"Process {process} of {count} did not finish its part of the restore "
            f"of {directory} within {timeout_s} s (Orbax's coordination timeout): "
            "it crashed, was killed, or is still reading. Look at that "
            "process's log; every process stops the restore."
        )
    name, _, message = outcome.partition("\n")
    note = (
        f"(Process {process} of {count} found this; every process of the "
        "restore stops with it.)"
    )
    kind = getattr(_errors, name, None)
    if isinstance(kind, type) and issubclass(kind, _errors.OrbaxEqxError):
        try:  # the same kind of error (where it is made of its message)
            error = kind(f"{message} {note}")
        except TypeError:
            error = None
        if error is not None and str(error) == f"{message} {note}":
            return error
    return RestoreFailedElsewhereError(
        f"Process {process} of {count} could not restore {directory}: "
        f"{name}: {message} {note}"
    )
