"""Object stores (`gs://`, `s3://`) through TensorStore's kvstore.

TensorStore brings what an object store needs and orbax_eqx already depends
on it: concurrent requests, bounded retries with backoff (throttling is
retried, a dead server fails in seconds), credentials from the standard
environment (see `endpoints`), and byte-range reads. Writes of large files
go out as parts (see `parts`), a few uploads in flight at once, each part
copied once into the bytes of its request: a save never holds more than
`_WRITE_WINDOW` parts beyond the arrays. Ranged reads are `object_reads`'
(and on S3, with botocore installed, `s3_reads`').

An object is replaced whole or not at all, so a whole-file write needs no
temporary name. Every wait is bounded (`patience`): no request blocks
forever. Whether a read that went wrong is the file's damage or the store's
failure is decided in `verdict`, for these reads as for `s3_reads`. An
endpoint that ignores `Range:` (answering 200 with the whole object) is
told by TensorStore from every answer; a read then takes its bytes from the
whole object, never others.
"""

import collections
import dataclasses
import functools
import json
from collections.abc import Iterable
from typing import Any

import tensorstore as ts

from .._errors import ObjectStoreError
from . import endpoints as _endpoints
from . import object_reads as _object_reads
from . import parts as _parts
from . import patience as _patience
from . import tries as _tries
from .store import BadFile, ErrorFor, Reader, Store

_WRITE_WINDOW = 2
_NO_VALUE = b"\x02"  # TensorStore's generation of a key that has no value
_RANGE_IGNORED = _object_reads.RANGE_IGNORED


class ObjectStore(Store):
    """The objects of one bucket."""

    def __init__(self, where: _endpoints.Where):
        self.where = where
        self._kv = ts.KvStore.open(where.spec()).result(
            timeout=_patience.operation_seconds()
        )

    def _key(self, path: Any) -> str:
        return _endpoints.split(str(path))[1]

    # -- requests, each bounded and with its errors worded ------------------

    def _result(self, future: Any, what: str, path: Any) -> Any:
        """The request's result; `ValueError` for OUT_OF_RANGE and for a
        range the server ignored (the caller decides), `ObjectStoreError`
        for the rest."""
        timeout = _patience.operation_seconds()
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise self._failed(
                what, path, f"no answer within {timeout:.0f} s, its tries included"
            ) from None
        except ValueError as e:
            text = str(e)
            if text.startswith("OUT_OF_RANGE") or _RANGE_IGNORED in text:
                raise
            raise self._failed(what, path, text) from None

    def _failed(self, what: str, path: Any, text: str) -> ObjectStoreError:
        return _tries.failed(self.where, what, path, text)

    def _read(self, key: str, path: Any, byte_range: slice | None = None) -> Any:
        future = self._kv.read(key, byte_range=byte_range)
        try:
            return self._result(future, "Reading", path)
        except ValueError as e:
            if _RANGE_IGNORED not in str(e):
                raise
            return self._from_whole(key, path, byte_range)

    def _from_whole(self, key: str, path: Any, byte_range: slice | None) -> Any:
        """A ranged read's bytes taken from the whole object: what an endpoint
        that ignores `Range:` answers (TensorStore refuses such an answer)."""
        got = self._result(self._kv.read(key), "Reading", path)
        if got.state == "missing" or byte_range is None:
            return got
        start, stop = byte_range.start or 0, byte_range.stop
        if stop is not None and len(got.value) < stop:
            raise ValueError("OUT_OF_RANGE: the object ends before the range")
        return _Value(got.value[start:stop], got.state, got.stamp)

    def holds(self, key: str, path: Any, end: int) -> bool | None:
        """Whether object `key` has at least `end` bytes now (None: there is
        no object): one small ranged read."""
        if end <= 0:
            return self._read(key, path, slice(0, 0)).state != "missing" or None
        try:
            got = self._read(key, path, slice(end - 1, end))
        except ValueError:  # OUT_OF_RANGE: ends before
            return False
        return None if got.state == "missing" else True

    def version(self, path: Any) -> Any:
        key = self._key(path)
        got = self._read(key, path, slice(0, 0))
        return None if got.state == "missing" else got.stamp.generation

    # -- the Store interface ------------------------------------------------

    def read_whole(self, path: Any, limit: int, error: ErrorFor) -> bytes:
        key = self._key(path)
        try:
            beyond = self._read(key, path, slice(limit, limit + 1))
        except ValueError:  # OUT_OF_RANGE: no byte past the limit
            beyond = None
        if beyond is not None:
            if beyond.state == "missing":
                raise FileNotFoundError(2, "No such object", str(path))
            raise error(f"has over {limit} bytes, more than the {limit} allowed")
        got = self._read(key, path)
        if got.state == "missing":
            raise FileNotFoundError(2, "No such object", str(path))
        if len(got.value) > limit:  # grew since
            raise error(f"has over {limit} bytes, more than the {limit} allowed")
        return got.value

    def write_whole(self, path: Any, data: bytes) -> None:
        self._result(self._kv.write(self._key(path), bytes(data)), "Writing", path)

    def write_new(self, path: Any, data: bytes) -> None:
        # A write on condition that there is no object yet (GCS
        # `ifGenerationMatch=0`, S3 `If-None-Match: *`); one refused resolves
        # to an empty generation.
        future = self._kv.write(self._key(path), bytes(data), if_equal=_NO_VALUE)
        if not self._result(future, "Writing", path).generation:
            raise FileExistsError(17, "Another writer's object is there", str(path))

    def write_stream(self, path: Any, parts: Iterable[memoryview], nbytes: int) -> None:
        key = self._key(path)
        if not _parts.count(nbytes):
            self.write_whole(path, b"".join(parts))
            return
        pending: collections.deque = collections.deque()
        index, held, size = 0, [], 0
        try:
            for part in _cut(parts, _parts.PART_BYTES):
                held.append(part)
                size += part.nbytes
                if size < _parts.PART_BYTES:
                    continue
                self._put(pending, key, path, index, held)
                index, held, size = index + 1, [], 0
            if held:
                self._put(pending, key, path, index, held)
            while pending:
                self._result(pending.popleft(), "Writing", path)
        finally:
            for future in pending:
                future.cancel()

    def _put(self, pending, key: str, path: Any, index: int, held: list) -> None:
        while len(pending) >= _WRITE_WINDOW:
            self._result(pending.popleft(), "Writing", path)
        data = b"".join(held)  # the one copy of these bytes
        pending.append(self._kv.write(_parts.part_name(key, index), data))

    def open(self, path: Any, end: int, nbytes: int | None) -> Reader:
        key = self._key(path)
        if nbytes is None or _parts.count(nbytes):
            head = self._read(key, path, slice(0, 0))
            if head.state == "missing":
                if nbytes is not None:
                    self._check_parts(key, path, nbytes)
                elif (
                    self._read(_parts.part_name(key, 0), path, slice(0, 0)).state
                    == "missing"
                ):
                    raise BadFile("is missing")
                # Without a recorded length, the reads check what they need.
                return _object_reads.ObjectReader(self, path, key, True)
        self._check_length(key, path, end, nbytes, "is missing")
        return _object_reads.ObjectReader(self, path, key, False)

    def _check_length(self, key, path, end: int, nbytes: int | None, missing: str):
        """Raises `BadFile` unless object `key` has `nbytes` bytes (if known),
        else at least `end`: one small ranged read."""
        self._checked(self._probe(key, end, nbytes), path, end, nbytes, missing)

    def _probe(self, key: str, end: int, nbytes: int | None) -> Any:
        """The request `_checked` judges: byte `nbytes` (there is none in a
        whole file), or the last byte of `end`."""
        probe = nbytes if nbytes is not None else max(end - 1, 0)
        return self._kv.read(key, byte_range=slice(probe, probe + 1))

    def _checked(self, request, path, end: int, nbytes: int | None, missing: str):
        try:
            got = self._result(request, "Reading", path)
        except ValueError as e:
            if _RANGE_IGNORED not in str(e):  # OUT_OF_RANGE: ends at or before
                if nbytes is None and end > 0:  # the probe
                    raise BadFile(f"ends before byte {end}") from None
                return
            # The whole object came, so it has the probe's byte (TensorStore
            # checks that a range it was not sent lies within what came).
            got = None
        if got is not None and got.state == "missing":
            raise BadFile(missing)
        if nbytes is not None:
            raise BadFile(f"has more bytes than the {nbytes} written")

    def _check_parts(self, key: str, path: Any, nbytes: int) -> None:
        """Each part's length, asked all at once (one round trip, not one a
        part)."""
        sizes = [
            min(_parts.PART_BYTES, nbytes - k * _parts.PART_BYTES)
            for k in range(_parts.count(nbytes))
        ]
        requests = [
            self._probe(_parts.part_name(key, k), size, size)
            for k, size in enumerate(sizes)
        ]
        try:
            for k, (request, size) in enumerate(zip(requests, sizes, strict=True)):
                self._checked(request, path, size, size, f"is missing its part {k}")
        finally:
            for request in requests:
                request.cancel()

    def check_reachable(self, path: Any) -> None:
        """Raises `ObjectStoreError`, naming the bucket, the endpoint and what
        to set, unless the store answers a read under `path` (one request)."""
        key = self._key(path).rstrip("/") + "/orbax_eqx.json"
        self._result(self._kv.read(key, byte_range=slice(0, 0)), "Reaching", path)
        # An object of a bucket that is not there reads as missing: asked
        # apart, or a save would make the bucket (s3fs does, for Orbax's
        # directories) and a restore would say only that nothing is there.
        if not self._bucket_exists(key, path):
            where = self.where
            make = (
                f"`gcloud storage buckets create gs://{where.bucket}`"
                if where.scheme == "gs"
                else f"`aws s3 mb s3://{where.bucket}`"
            )
            raise ObjectStoreError(
                f"The {where.describe()} does not exist (reaching {path}). "
                f"Correct the bucket's name, or create the bucket ({make}) "
                "before saving to it."
            )

    def _bucket_exists(self, key: str, path: Any) -> bool:
        if self.where.scheme == "s3":
            # Listing one key: S3 says NoSuchBucket where a read said missing.
            listed = self._kv.list(ts.KvStore.KeyRange(key, key + "\0"))
            try:
                self._result(listed, "Reaching", path)
            except ObjectStoreError as e:
                if "NoSuchBucket" in str(e):
                    return False
                raise
            return True
        # TensorStore's gcs driver lists a missing bucket as empty; gcsfs,
        # which Orbax reaches gs:// through, tells.
        try:
            import gcsfs  # noqa: F401  (the `gcs` extra)
            from etils import epath
        except ImportError:
            return True
        try:
            return epath.Path(f"gs://{self.where.bucket}").exists()
        except Exception:  # no answer: the requests after this one say why
            return True

    def wrap(
        self, error: BaseException, path: Any, what: str = "Saving to"
    ) -> BaseException:
        """An error of the filesystem library Orbax makes directories with
        (s3fs, gcsfs: no credentials, no endpoint), as an `ObjectStoreError`
        that says what to set; other errors as they are."""
        module = type(error).__module__.split(".")[0]
        if module not in _tries.FSSPEC_MODULES:
            return error
        return self._failed(what, path, f"{type(error).__name__}: {error}")

    def exists(self, path: Any) -> bool:
        key = self._key(path)
        if self._read(key, path, slice(0, 0)).state != "missing":
            return True
        first = _parts.part_name(key, 0)
        return self._read(first, path, slice(0, 0)).state != "missing"

    def delete(self, path: Any) -> None:
        key = self._key(path)
        self._result(
            self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")),
            "Deleting",
            path,
        )
        first = _parts.part_name(key, 0)[: -len("00000")]  # `{key}.part-`
        last = first[:-1] + chr(ord(first[-1]) + 1)
        self._result(
            self._kv.delete_range(ts.KvStore.KeyRange(first, last)), "Deleting", path
        )


def _cut(views: Iterable[memoryview], size: int) -> Iterable[memoryview]:
    """The views, split where they cross a multiple of `size` bytes."""
    at = 0
    for view in views:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        while view.nbytes:
            room = size - at % size
            head, view = view[:room], view[room:]
            at += head.nbytes
            yield head


@dataclasses.dataclass(frozen=True)
class _Value:
    """A read's result, as TensorStore's `ReadResult` has it."""

    value: bytes
    state: str
    stamp: Any


@functools.lru_cache(maxsize=64)
def _store(spec_json: str, where: _endpoints.Where) -> ObjectStore:
    del spec_json  # part of the cache key: the environment it was made in
    return ObjectStore(where)


def store_for(url: str) -> ObjectStore:
    """The store of the bucket `url` is in, reached as the environment says now."""
    where, _ = _endpoints.split(url)
    _patience.configure_tensorstore()  # before TensorStore's first request
    return _store(json.dumps(where.spec(), sort_keys=True), where)
