"""Damage, or a store that failed: decided here, for every read of a checkpoint.

A read can go wrong two ways that call for opposite actions. The bytes may be
wrong where they are stored (damage: restore an older step, re-save), or the
store and the network between may have failed to deliver them (a failure:
try again; the checkpoint is intact). Telling one for the other loses a
healthy step, or hides a damaged one. The rules:

1. A ranged read that fails (a 5xx answer, throttling, a dropped or reset
   connection) or whose answer is not the bytes asked (a body cut short, a
   `Content-Range` other than the one asked) is read again, up to
   `patience.RETRIES` times with backoff (`ranged`). After a short answer the
   object's length is asked: an object shorter than the read needs, or gone,
   is the file's damage (`BadFile`, which the caller words; a restore then
   tells a checkpoint deleted meanwhile, see `_restore/vanished.py`); one
   that holds the bytes is read again, and answers that stay short are the
   store's failure.
2. A request that stalls (`patience.stall_seconds()` without progress) is
   tried once more; a second stall is the store's failure.
3. Bytes that fail their checksum, or a sidecar that fails its checks, read
   from an object store, are read again (`confirmed`: the whole item, up to
   `AGAIN` more times). The same failure twice is damage: the stored bytes
   are wrong. A read that passes is used. Failures that differ on every read
   are the store's: something between it and this process changes bytes.
4. A store's failure is an `ObjectStoreError`, never damage, wherever it comes
   from (`store_failure`: also the raw errors of the libraries Orbax reaches
   stores through): `restore_latest` raises it rather than falling back to
   an older step, which would only meet the same store.

Rules 1 and 2 are one request's, in `tries` (`ranged`, `Retry`, and `failed`,
which words every `ObjectStoreError` of a request); rules 3 and 4 judge
whole reads, here.
"""

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import (
    CheckpointDamagedError,
    ObjectStoreError,
    SidecarError,
    bullet_list,
)
from . import patience
from .paths import is_remote
from .route import for_path
from .tries import FSSPEC_MODULES

_T = TypeVar("_T")

AGAIN = 2  # more reads of an item whose bytes failed their checks


def confirmed(
    path: Any,
    read: Callable[[], _T],
    damage: Callable[[_T], str] = lambda result: "",
) -> _T:
    """`read()` (a restore or a check of the item at `path`), done again while
    its bytes fail their checks differently each time (rule 3).

    A failed check is a `CheckpointDamagedError` or `SidecarError` raised, or
    a result for which `damage(result)` is not empty (a report that lists
    damaged leaves). On a local disk a failed check is the file's: there is
    no second read.
    """
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
            found = damage(result)
            if not found or found in seen:
                return result
            seen.append(found)
        if attempt < AGAIN:
            time.sleep(patience.backoff(attempt))
    where = getattr(for_path(path), "where", None)  # an object store's endpoint
    source = where.describe() if where is not None else str(path)
    raise ObjectStoreError(
        f"Reading {path} from {source} gave different bytes on "
        f"each of {len(seen)} reads: something between the store and this "
        "process (a proxy, a cache, a faulty network card) changes bytes in "
        "transit, and the checkpoint itself may be intact. The checks "
        "failed so:\n"
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
    that holds `path` (rule 4); None if it may be damage or a deletion.

    Orbax reaches stores through s3fs and gcsfs, whose errors come raw, or
    turned into builtin ones (s3fs: `OSError(EBUSY, "Service Unavailable")`
    caused by botocore's error): the cause is looked for along the chain. An
    answer that the object is not there is no failure of the store.
    """
    if isinstance(error, ObjectStoreError):
        return error
    if not is_remote(path):
        return None
    cause = _store_cause(error)
    if cause is None or _says_missing(cause):
        return None
    wrapped = for_path(path).wrap(cause, path, "Reading")
    return wrapped if isinstance(wrapped, ObjectStoreError) else None


def _store_cause(error: BaseException) -> BaseException | None:
    """The first error along `error`'s causes raised by a library that talks
    to stores (`FSSPEC_MODULES`), if any."""
    seen: set[int] = set()
    at: BaseException | None = error
    while at is not None and id(at) not in seen and len(seen) < 16:
        seen.add(id(at))
        if type(at).__module__.split(".")[0] in FSSPEC_MODULES:
            return at
        at = at.__cause__ or at.__context__
    return None


def _says_missing(error: BaseException) -> bool:
    """Whether the store answered that the object (not the bucket) is not
    there: a deletion or damage, for the caller to tell."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("NoSuchKey", "NotFound", "404") or (
            status == 404 and code != "NoSuchBucket"
        )
    return getattr(error, "code", None) == 404  # gcsfs's HttpError
