"""One request's tries on an object store, and the words of its failure.

Rules 1 and 2 of `verdict`: a ranged read that fails or answers other bytes
than asked is read again (`ranged`, raising `Retry` for each try that went
wrong), a request that stalls is tried once more, and after its tries a
request's `ObjectStoreError` says what failed, where, the store's answer and
the one hint that fits (`failed`). Used by the stores (`objects`,
`object_reads`, `s3_reads`), below `verdict`, which judges whole reads.
"""

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._errors import ObjectStoreError
from . import patience
from .store import BadFile

_T = TypeVar("_T")

# What an error's text says went wrong, for the hint (see `failed`).
_ACCESS = (
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "NoCredentialsError",
    "PartialCredentialsError",
    "NoSuchBucket",
    "HTTP 401",
    "HTTP 403",
    "status 401",
    "status 403",
)
_UNREACHED = (
    "Could not connect",
    "Couldn't connect",
    "Could not resolve",
    "Couldn't resolve",
    "EndpointConnectionError",
    "Connection refused",
)
# S3's error codes of the statuses a failing store answers (TensorStore's text
# does not always keep the status itself).
_STATUS_OF = {
    "SlowDown": 503,
    "ServiceUnavailable": 503,
    "InternalError": 500,
    "RequestTimeout": 400,
}
# Where the raw errors of Orbax's own calls on object stores come from.
FSSPEC_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp")


class Retry(Exception):
    """One try of a ranged read that went wrong in a way worth another.

    `detail` says how; `short`: the answer had fewer bytes (or others) than
    asked, so the object's length decides in the end; `stall`: nothing moved
    for `patience.stall_seconds()`.
    """

    def __init__(self, detail: str, *, short: bool = False, stall: bool = False):
        super().__init__(detail)
        self.detail, self.short, self.stall = detail, short, stall


def ranged(
    once: Callable[[], _T],
    holds: Callable[[], bool | None],
    failure: Callable[[str], ObjectStoreError],
    end: int,
    stopped: Callable[[], bool] = lambda: False,
) -> _T | None:
    """`once()`, tried again while it raises `Retry` (rules 1 and 2).

    **Arguments:**

    - `once`: one try of the read; raises `Retry`, `BadFile` (the file's
        damage, final) or `ObjectStoreError` (final).
    - `holds`: whether the object holds the bytes the read needs now (None:
        there is no object); asked after each short answer.
    - `failure`: the store's error for a detail.
    - `end`: the byte of the file the read needs, for a `BadFile`.
    - `stopped`: whether the reads were cancelled (then None is returned).
    """
    stalls = 0
    for attempt in range(patience.RETRIES + 1):
        if stopped():
            return None
        try:
            return once()
        except Retry as e:
            last = e
        if last.short:
            held = holds()
            if held is None:
                raise BadFile("is missing")
            if not held:
                raise BadFile(f"ends before byte {end}")
        stalls += last.stall
        if stalls >= patience.STALL_TRIES or attempt == patience.RETRIES:
            break
        time.sleep(patience.backoff(attempt))
    if last.stall:
        raise failure(f"{last.detail} (twice)")
    though = ", though the object holds the bytes asked" if last.short else ""
    raise failure(f"{last.detail} (on each of {attempt + 1} tries{though})")


def failed(where: Any, what: str, path: Any, detail: str) -> ObjectStoreError:
    """The error of a request that failed after its tries: what, where, the
    answer, and the hint that fits it (credentials, the endpoint, or none:
    a store that failed is not fixed by settings)."""
    first = detail.split("[http_response_body")[0].strip().rstrip(".")
    status = next((n for code, n in _STATUS_OF.items() if code in first), None)
    said = ("http_response_code", f"HTTP {status}")
    if status is not None and not any(sign in first for sign in said):
        first += f" (HTTP {status})"  # TensorStore's text may lose the number
    if any(sign in first for sign in _ACCESS):
        hint = where.setup_hint()
    elif any(sign in first for sign in _UNREACHED):
        hint = where.endpoint_hint()
    else:
        hint = (
            "The store failed, not the checkpoint: this is no sign of damage. Try "
            "again later, and check the store's health if it goes on (a "
            f"request is abandoned after {patience.stall_seconds():g} s "
            f"without progress, {patience.ENV}, and a failed one is tried "
            f"{patience.RETRIES} more times)."
        )
    return ObjectStoreError(
        f"{what} {path} failed at {where.describe()}: {first}. {hint}"
    )
