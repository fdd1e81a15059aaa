"""Ranged reads of S3 objects streamed straight into the caller's buffers.

TensorStore's Python API hands each response over as a `bytes` object, so a
read through it holds every byte in flight about twice before the copy into
the buffer: memory grows with the window, and the window has to stay small.
Here each ranged GET is signed and sent by botocore (which s3fs, needed for
Orbax's directories on `s3://`, brings) and its body is read with `readinto`
into the slice of the buffer it belongs to: nothing is held beside the
buffers, so whole parts can be asked for, several at once, which is what
object stores serve fastest.

The client finds the endpoint, region and credentials in the standard AWS
environment, as TensorStore does (`endpoints`). Every answer is checked
before its bytes are taken: a 206 must carry exactly the `Content-Range`
asked; a 200 is the whole object (an endpoint or caching proxy that ignores
`Range:`), whose bytes before the range are read past, not kept. Tries are
ours, not botocore's, so that each failure is judged by the rules of
`verdict` (with the timeouts of `patience`): a throttled, failed, cut short
or stalled GET is sent again, a short answer is checked against the object's
length, and nothing waits forever.
"""

import concurrent.futures
import functools
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import endpoints as _endpoints
from . import patience as _patience
from . import tries as _tries
from .store import BadFile, InOrder

PIECE = 32 << 20  # bytes asked in one GET: a whole part
WINDOW = 4  # GETs in flight
_SKIP = 1 << 20  # bytes read at a time past the start of a whole object
# Answers worth another try: throttling, and the store's own failures.
_AGAIN_CODES = (
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def available() -> bool:
    """Whether botocore is installed (it comes with the `s3` extra)."""
    try:
        import botocore  # noqa: F401
    except ImportError:
        return False
    return True


def client(where: _endpoints.Where) -> Any:
    """A botocore S3 client for `where`, with the stall timeout now set."""
    return _client(where, _patience.stall_seconds())


@functools.lru_cache(maxsize=16)
def _client(where: _endpoints.Where, stall: float) -> Any:
    import botocore.config
    import botocore.session

    config = botocore.config.Config(
        # One try per call: `S3Reads` tries again, by `verdict`'s rules.
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=stall,
        read_timeout=stall,  # between two reads of the socket: no progress
        max_pool_connections=2 * WINDOW,
        s3={"addressing_style": "path"} if where.endpoint else None,
    )
    return botocore.session.get_session().create_client(
        "s3",
        region_name=where.region or "us-east-1",
        endpoint_url=where.endpoint,
        config=config,
    )


class S3Reads(InOrder):
    """Jobs `(buffer, start in it, stop in it, key, start, stop, end of the
    range in the file)` read in order of need, `WINDOW` at a time, each
    straight into its buffer."""

    def __init__(self, store: Any, path: Any, jobs, buffers: Sequence[np.ndarray]):
        super().__init__(jobs, buffers)
        self._store, self._path = store, path
        self._client = client(store.where)
        self._pool = concurrent.futures.ThreadPoolExecutor(WINDOW)
        self._stop = threading.Event()
        self._futures = [self._pool.submit(self._fill, job) for job in jobs]

    def _fill(self, job) -> None:
        i, at, to, key, a, z, end = job
        view = memoryview(self._buffers[i]).cast("B")[at:to]
        _tries.ranged(
            lambda: self._once(view, key, a, z),
            lambda: self._store.holds(key, self._path, z),
            lambda detail: self._store._failed("Reading", self._path, detail),
            end,
            self._stop.is_set,
        )

    def _once(self, view: memoryview, key: str, a: int, z: int) -> None:
        """One GET of bytes `[a, z)` of `key` into `view`; raises `Retry` for
        what is worth another try."""
        import botocore.exceptions as errors

        try:
            answer = self._client.get_object(
                Bucket=self._store.where.bucket, Key=key, Range=f"bytes={a}-{z - 1}"
            )
            body = answer["Body"]
            try:
                skip = _checked_answer(answer, key, a, z)
                got = _read_into(body, view, skip, self._stop)
            finally:
                body.close()
        except errors.ClientError as e:
            judged = _judged(e, key, z)
            if isinstance(judged, str):  # the store's answer for good
                raise self._store._failed("Reading", self._path, judged) from None
            raise judged from None
        except (errors.ReadTimeoutError, errors.ConnectTimeoutError) as e:
            raise _tries.Retry(_stalled(e, key), stall=True) from None
        except errors.IncompleteReadError as e:  # a body cut short
            raise _tries.Retry(f"{type(e).__name__}: {e}", short=True) from None
        except (
            errors.EndpointConnectionError,
            errors.ConnectionClosedError,
            errors.ResponseStreamingError,  # a connection reset halfway
        ) as e:
            raise _tries.Retry(f"{type(e).__name__}: {e}") from None
        except errors.BotoCoreError as e:
            raise self._store._failed(
                "Reading", self._path, f"{type(e).__name__}: {e}"
            ) from None
        if got != z - a and not self._stop.is_set():
            raise _tries.Retry(
                f"the answer to a GET of bytes {a}-{z - 1} of {key} ended after "
                f"{got} bytes",
                short=True,
            )

    def _finish_next(self) -> None:
        self._futures[self._done].result()  # bounded: every request times out

    def cancel(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _checked_answer(answer: dict, key: str, a: int, z: int) -> int:
    """How many bytes of the body come before byte `a`: 0 for a 206 with the
    range asked, `a` for a 200 (the whole object); `Retry` for anything else."""
    status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
    length = answer.get("ContentLength")
    asked = f"bytes {a}-{z - 1}"
    if status == 206:
        found = _CONTENT_RANGE.fullmatch(str(answer.get("ContentRange", "")))
        if found and (int(found[1]), int(found[2]) + 1) == (a, z) and length == z - a:
            return 0
        raise _tries.Retry(
            f"a GET of {asked} of {key} was answered with "
            f"{answer.get('ContentRange')!r} ({length} bytes)",
            short=True,
        )
    if status == 200 and isinstance(length, int):
        if length < z:
            raise _tries.Retry(
                f"a GET of {asked} of {key} was answered with the whole object "
                f"({length} bytes)",
                short=True,
            )
        return a
    raise _tries.Retry(f"a GET of {asked} of {key} was answered HTTP {status}")


def _read_into(body: Any, view: memoryview, skip: int, stop: threading.Event) -> int:
    """Reads past `skip` bytes of `body`, then into `view`; returns the bytes
    put in `view` (fewer if the body ends first, or the reads are cancelled)."""
    if skip:
        scratch = memoryview(bytearray(min(_SKIP, skip)))
        while skip and not stop.is_set():
            n = body.readinto(scratch[: min(skip, len(scratch))])
            if not n:
                return 0
            skip -= n
    got = 0
    while got < len(view) and not stop.is_set():
        n = body.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _judged(error: Any, key: str, z: int) -> Exception | str:
    """A refused GET as what it means: a missing object or range is the
    file's (`BadFile`), throttling and 5xx are worth another try (`Retry`),
    the rest is the store's answer for good (its detail)."""
    response = error.response
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchKey", "404") or status == 404 and code != "NoSuchBucket":
        return BadFile("is missing")
    if code in ("InvalidRange", "416") or status == 416:
        return _tries.Retry(f"HTTP 416 {code}: no bytes up to {z} in {key}", short=True)
    message = response.get("Error", {}).get("Message", "")
    detail = f"HTTP {status} {code}: {message}".rstrip(": ")
    if code in _AGAIN_CODES or (isinstance(status, int) and status >= 500):
        return _tries.Retry(detail)
    return detail


def _stalled(error: Exception, key: str) -> str:
    seconds = _patience.stall_seconds()
    if "Connect" in type(error).__name__:
        return f"no connection within {seconds:g} s, for a GET of {key}"
    return f"no byte within {seconds:g} s, in a GET of {key}"
