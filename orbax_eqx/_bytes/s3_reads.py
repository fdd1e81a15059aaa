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
environment, as TensorStore does (`endpoints`). Retries are botocore's
"standard" mode, bounded (throttling, 5xx, dropped connections); every
connection and read has a timeout: nothing waits forever.
"""

import concurrent.futures
import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import ObjectStoreError
from . import endpoints as _endpoints
from .store import BadFile, InOrder

PIECE = 32 << 20  # bytes asked in one GET: a whole part
WINDOW = 4  # GETs in flight
_TIMEOUT = 60  # seconds to connect, and between two reads of one response


def available() -> bool:
    """Whether botocore is installed (it comes with the `s3` extra)."""
    try:
        import botocore  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=16)
def client(where: _endpoints.Where) -> Any:
    """A botocore S3 client for `where`, made once (they are thread-safe)."""
    import botocore.config
    import botocore.session

    config = botocore.config.Config(
        retries={"max_attempts": _endpoints.RETRIES["max_retries"], "mode": "standard"},
        connect_timeout=_TIMEOUT,
        read_timeout=_TIMEOUT,
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
        import botocore.exceptions

        i, at, to, key, a, z, end = job
        if self._stop.is_set():
            return
        view = memoryview(self._buffers[i]).cast("B")[at:to]
        try:
            answer = self._client.get_object(
                Bucket=self._store.where.bucket, Key=key, Range=f"bytes={a}-{z - 1}"
            )
            body = answer["Body"]
            try:
                got = 0
                while got < z - a and not self._stop.is_set():
                    n = body.readinto(view[got:])
                    if not n:
                        break
                    got += n
            finally:
                body.close()
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404"):
                raise BadFile("is missing") from None
            if code in ("InvalidRange", "416"):
                raise BadFile(f"ends before byte {end}") from None
            raise self._failed(e) from None
        except botocore.exceptions.BotoCoreError as e:
            raise self._failed(e) from None
        if got != z - a and not self._stop.is_set():
            raise BadFile(f"ends before byte {end}")

    def _failed(self, error: BaseException) -> ObjectStoreError:
        return self._store._failed(
            "Reading", self._path, f"{type(error).__name__}: {error}"
        )

    def _finish_next(self) -> None:
        self._futures[self._done].result()  # bounded: every request times out

    def cancel(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
