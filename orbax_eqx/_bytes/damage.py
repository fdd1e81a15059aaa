"""Damage, or a store that failed: what a restore and `verify` call damage."""

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import (
    CheckpointDamagedError,
    ObjectStoreError,
    SidecarError,
    bullet_list,
)
from .route import for_path, is_remote

_T = TypeVar("_T")

AGAIN = 2  # more reads of an item whose bytes failed their checks
_WAIT_S = 0.5  # before each


def confirmed(
    path: Any, read: Callable[[], _T], damage: Callable[[_T], str] | None = None
) -> _T:
    """`read()` (a restore or a check of the item at `path`), done again
    while its bytes fail their checks differently each time."""
    if not is_remote(path):
        return read()
    seen: list[str] = []
    for attempt in range(AGAIN + 1):
        try:
            result = read()
        except (CheckpointDamagedError, SidecarError) as e:
            if str(e) in seen:
                raise  # the same bytes again: they are stored so
            seen.append(str(e))
        else:
            found = damage(result) if damage is not None else ""
            if not found or found in seen:
                return result
            seen.append(found)
        if attempt < AGAIN:
            time.sleep(_WAIT_S * (attempt + 1))
    where = getattr(for_path(path), "where", str(path))  # the store's endpoint
    raise ObjectStoreError(
        f"Reading {path} from {where} gave different bytes on each of "
        f"{len(seen)} reads: something between the store and this process (a "
        "proxy, a cache, a faulty network card) changes bytes in transit, and "
        "the checkpoint itself may be intact. The checks failed so:\n"
        + bullet_list([_gist(text) for text in seen])
        + "\nTry again, and check the way to the store; `python -m orbax_eqx "
        "verify PATH` from another machine tells whether the stored bytes are "
        "damaged."
    )


def _gist(text: str) -> str:
    """The first problem a failed check lists (its first line, if none)."""
    lines = text.splitlines()
    listed = [line.strip()[2:] for line in lines if line.startswith("  - ")]
    return (listed or lines or ["(no message)"])[0]


def store_failure(error: BaseException, path: Any) -> ObjectStoreError | None:
    """`error` as the `ObjectStoreError` it is, if it is a failure of the store
    that holds `path`; None if it may be damage or a deletion (an answer
    that an object is not there is no failure of the store)."""
    if isinstance(error, ObjectStoreError):
        return error
    if not is_remote(path):
        return None
    wrapped = for_path(path).wrap(error, path, "Reading")
    return wrapped if isinstance(wrapped, ObjectStoreError) else None
