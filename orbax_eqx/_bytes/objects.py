"""Object stores (`gs://`, `s3://`) through TensorStore's kvstore: one client."""

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from .._errors import ObjectStoreError, OrbaxEqxError
from . import store as _parts  # (how a large file is cut into objects)
from .store import BadFile, ErrorFor, Reader, Reads, Store

STALL_ENV = "ORBAX_EQX_STALL_SECONDS"
_RETRIES = {"max_retries": 6, "initial_delay": "0.2s", "max_delay": "4s"}
_RETRY_WAITS_S = sum(min(0.2 * 2**k, 4.0) for k in range(6))
_CONCURRENCY = 32  # requests in flight to one store
_PIECE, _WINDOW, _WRITE_WINDOW = 8 << 20, 4, 2  # bytes a read, reads, uploads
_NO_VALUE = b"\x02"  # TensorStore's generation of a key that has no value
_IGNORED = "was ignored by server"  # TensorStore: the whole object came
_TOTAL = re.compile(r"and total size (\d+)")
_STATUS = re.compile(r"http_response_code='(\d+)'")
# Modules whose raw errors Orbax's own calls on object stores raise.
_FSSPEC = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp")
_ACCESS = (  # what an error's text says, for the hint that fits
    *("PERMISSION_DENIED", "UNAUTHENTICATED", "AccessDenied", "HTTP 403"),
    *("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"),
    *("NoCredentialsError", "PartialCredentialsError", "NoSuchBucket"),
)
_UNREACHED = (
    *("Could not connect", "Couldn't connect", "Could not resolve"),
    *("EndpointConnectionError", "Connection refused"),
)


class ObjectPathError(OrbaxEqxError, ValueError):
    """An object-store path orbax_eqx cannot use."""


class StallSettingError(OrbaxEqxError, ValueError):
    """`ORBAX_EQX_STALL_SECONDS` is set to something that is not a time."""


def _stall_s() -> float:
    text = os.environ.get(STALL_ENV, "").strip()
    try:
        value = float(text) if text else 60.0
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 86400):
        raise StallSettingError(
            f"{STALL_ENV} is {os.environ[STALL_ENV]!r}: expected the seconds a "
            "request to an object store may go without progress, a number above "
            f"0 and at most 86400 (default 60). Set it to, say, `{STALL_ENV}=60`, "
            "or unset it."
        )
    return value


def _wait_s() -> float:
    """The longest wait on one request, its tries included: two stalls, and
    the backoff between all its tries, and TensorStore's queueing."""
    return 2 * _stall_s() + _RETRY_WAITS_S + 5


@dataclasses.dataclass(frozen=True)
class Where:
    """One bucket of one store, and how to reach it."""

    scheme: str  # "gs" or "s3"
    bucket: str
    endpoint: str | None  # None: the store's own
    region: str | None
    keys: bool  # S3 keys in the environment

    def __str__(self) -> str:
        own = "Google Cloud Storage" if self.scheme == "gs" else "AWS S3"
        return f"bucket {self.bucket!r} at {self.endpoint or own}"

    def spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of the bucket's root."""
        driver = "gcs" if self.scheme == "gs" else "s3"
        spec: dict[str, Any] = {"driver": driver, "bucket": self.bucket}
        spec["context"] = {
            f"{driver}_request_retries": _RETRIES,
            f"{driver}_request_concurrency": {"limit": _CONCURRENCY},
        }
        if driver == "s3":
            spec["aws_region"] = self.region or "us-east-1"
            if self.endpoint:
                spec["endpoint"] = self.endpoint
            if self.keys:  # else the default chain (profiles, instance roles)
                spec["aws_credentials"] = {"type": "environment"}
        return spec

    def hint(self, detail: str) -> str:
        """What to do about a request that failed so, for messages."""
        gs = self.scheme == "gs"
        if any(sign in detail for sign in _ACCESS):
            return "Check the bucket exists and your credentials reach it " + (
                "(GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth application-default"
                " login`); for an emulator set TENSORSTORE_GCS_HTTP_URL."
                if gs
                else "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE); "
                "for an S3-compatible store set AWS_ENDPOINT_URL, and AWS_REGION if "
                "it needs one."
            )
        if any(sign in detail for sign in _UNREACHED):
            kind = "an emulator" if gs else "an S3-compatible store"
            name = "TENSORSTORE_GCS_HTTP_URL" if gs else "AWS_ENDPOINT_URL"
            return (
                f"Check the store is up and reachable from here; for {kind} set "
                f"{name} to where it listens."
            )
        return (
            "The store failed, not the checkpoint: this is no sign of damage. Try "
            "again later, and check the store's health if it goes on (a request "
            f"is abandoned after {_wait_s():.0f} s, its tries included; "
            f"{STALL_ENV}={_stall_s():g})."
        )


def split(url: str) -> tuple[Where, str]:
    """`s3://bucket/a/b` as `(where, "a/b")`, reached as the environment says."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("gs", "s3"):
        raise ObjectPathError(
            f"{url} is on a store orbax_eqx cannot write: it knows local paths, "
            "gs:// and s3://. Save to one of those (or to a local path mounted "
            "from the store)."
        )
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ObjectPathError(f"{url} names no bucket: write {scheme}://BUCKET/path.")
    env = os.environ
    if scheme == "gs":
        emulator, endpoint = (
            env.get("STORAGE_EMULATOR_HOST"),
            env.get("TENSORSTORE_GCS_HTTP_URL"),
        )
        if emulator and not endpoint:
            url = emulator if "://" in emulator else f"http://{emulator}"
            raise ObjectStoreError(
                f"STORAGE_EMULATOR_HOST is {emulator!r}, but TensorStore, which "
                "orbax_eqx reads and writes gs:// through, takes its endpoint only "
                f"from TENSORSTORE_GCS_HTTP_URL: set TENSORSTORE_GCS_HTTP_URL={url} "
                "(and GOOGLE_AUTH_TOKEN_FOR_TESTING=owner, so that it looks for no "
                "Google credentials), or unset STORAGE_EMULATOR_HOST to reach "
                "Google Cloud Storage."
            )
        return Where("gs", bucket, endpoint, None, False), key.strip("/")
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    keys = bool(env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"))
    return Where("s3", bucket, endpoint, region, keys), key.strip("/")


class ObjectStore(Store):
    """The objects of one bucket."""

    def __init__(self, where: Where):
        self.where = where
        self._kv = ts.KvStore.open(where.spec()).result(timeout=_wait_s())

    def _key(self, path: Any) -> str:
        return split(str(path))[1]

    def failed(self, what: str, path: Any, detail: str) -> ObjectStoreError:
        """The error of a request that failed after its tries: what, where,
        the store's answer, and the one hint that fits it."""
        first = detail.split("[http_response_body")[0].strip().rstrip(".")
        status = _STATUS.search(detail)
        if status and status[0] not in first:  # TensorStore's text may lose it
            first += f" (HTTP {status[1]})"
        return ObjectStoreError(
            f"{what} {path} failed at {self.where}: {first}. {self.where.hint(first)}"
        )

    def result(self, future: Any, what: str, path: Any) -> Any:
        """A request's result, waited on for at most `_wait_s()`. `ValueError`
        for an answer of other bytes than asked (the caller decides),
        `ObjectStoreError` for the rest."""
        timeout = _wait_s()
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise self.failed(
                what, path, f"no answer within {timeout:.0f} s, its tries included"
            ) from None
        except ValueError as e:
            if str(e).startswith("OUT_OF_RANGE") or _IGNORED in str(e):
                raise
            raise self.failed(what, path, str(e)) from None

    def read(self, key: str, path: Any, start: int = 0, stop: int | None = None) -> Any:
        """Bytes `[start, stop)` of object `key` (a ReadResult), or "short" if
        it ends before `stop`. An answer of other bytes (the whole object,
        another range) is read again as the whole object, and sliced."""
        ranged = None if (start, stop) == (0, None) else slice(start, stop)
        try:
            return self.result(self._kv.read(key, byte_range=ranged), "Reading", path)
        except ValueError as e:
            total = _TOTAL.search(str(e))  # TensorStore: "... and total size N"
            if _IGNORED not in str(e) and (not total or int(total[1]) < (stop or 0)):
                return "short"  # (416: it starts past the end)
        whole = self.result(self._kv.read(key), "Reading", path)
        if whole.state == "missing" or ranged is None:
            return whole
        if len(whole.value) < (stop or start):
            return "short"
        return _Value(whole.value[start:stop], whole.state, whole.stamp)

    def probe(self, key: str, path: Any, at: int) -> Any:
        """The object's generation if it has byte `at` (any object, for -1),
        "short" if it ends before, None if there is no object."""
        got = self.read(key, path, max(at, 0), at + 1)
        if got == "short" or got.state == "missing":
            return None if got != "short" else "short"
        return got.stamp.generation

    def version(self, path: Any) -> Any:
        return self.probe(self._key(path), path, -1)

    def exists(self, path: Any) -> bool:
        key = self._key(path)
        return any(self.probe(k, path, -1) for k in (key, _parts.part_name(key, 0)))

    def read_whole(self, path: Any, limit: int, error: ErrorFor) -> bytes:
        key = self._key(path)
        beyond = self.probe(key, path, limit)
        if beyond is None:
            raise FileNotFoundError(2, "No such object", str(path))
        got = self.read(key, path) if beyond == "short" else None
        if got is None or len(got.value) > limit:  # (grew since)
            raise error(f"has over {limit} bytes, more than the {limit} allowed")
        if got.state == "missing":
            raise FileNotFoundError(2, "No such object", str(path))
        return got.value

    def write_whole(self, path: Any, data: bytes) -> None:
        self.result(self._kv.write(self._key(path), bytes(data)), "Writing", path)

    def write_new(self, path: Any, data: bytes) -> None:
        # On condition that there is no object yet (GCS `ifGenerationMatch=0`,
        # S3 `If-None-Match: *`); one refused resolves to an empty generation.
        future = self._kv.write(self._key(path), bytes(data), if_equal=_NO_VALUE)
        if not self.result(future, "Writing", path).generation:
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
                if size == _parts.PART_BYTES:
                    self._put(pending, key, path, index, held)
                    index, held, size = index + 1, [], 0
            if held:
                self._put(pending, key, path, index, held)
            while pending:
                self.result(pending.popleft(), "Writing", path)
        finally:
            for future in pending:
                future.cancel()

    def _put(self, pending, key: str, path: Any, index: int, held: list) -> None:
        while len(pending) >= _WRITE_WINDOW:
            self.result(pending.popleft(), "Writing", path)
        data = b"".join(held)  # the one copy of these bytes
        pending.append(self._kv.write(_parts.part_name(key, index), data))

    def open(self, path: Any, end: int, nbytes: int | None) -> Reader:
        key = self._key(path)
        found = self.probe(key, path, end - 1)
        if found is not None:
            self._check(found, key, path, end, nbytes, "")
            return ObjectReader(self, path, {key: found})
        if nbytes is not None and not _parts.count(nbytes):
            raise BadFile("is missing")
        total = end if nbytes is None else nbytes
        keys = [_parts.part_name(key, k) for k in range(max(_parts.count(total), 1))]

        def check(k: int) -> Any:  # each part full, but the last
            want = min(_parts.PART_BYTES, total - k * _parts.PART_BYTES)
            exact = nbytes is not None or k < len(keys) - 1
            found = self.probe(keys[k], path, want - 1)
            if found is None:
                raise BadFile(f"is missing its part {k}" if k else "is missing")
            self._check(found, keys[k], path, want, want if exact else None, k)
            return found

        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # at once
            return ObjectReader(
                self,
                path,
                dict(zip(keys, pool.map(check, range(len(keys))), strict=True)),
            )

    def _check(
        self, found: Any, key: str, path: Any, end: int, nbytes: int | None, k: Any
    ) -> None:
        """Raises `BadFile` unless object `key` (part `k`), `found` by a probe
        of byte `end - 1`, holds `end` bytes and at most `nbytes`."""
        part = "" if k == "" else f"a part {k} of "
        if found == "short":
            raise BadFile(
                f"has {part}fewer bytes than the {end} written"
                if part
                else f"ends before byte {end}"
            )
        if nbytes is not None and self.probe(key, path, nbytes) not in ("short", None):
            raise BadFile(f"has {part}more bytes than the {nbytes} written")

    def check_reachable(self, path: Any) -> None:
        """Raises `ObjectStoreError`, naming the bucket, the endpoint and what
        to set, unless the store answers a read under `path`, and the bucket
        exists (an object of a missing bucket reads as missing)."""
        key = self._key(path).rstrip("/") + "/orbax_eqx.json"
        self.result(self._kv.read(key, byte_range=slice(0, 0)), "Reaching", path)
        name, gs = self.where.bucket, self.where.scheme == "gs"
        if gs and _gcs_bucket_exists(name):  # TensorStore lists none as empty
            return
        if not gs:  # listing a key: S3 says NoSuchBucket
            try:
                listed = self._kv.list(ts.KvStore.KeyRange(key, key + "\0"))
                self.result(listed, "Reaching", path)
                return
            except ObjectStoreError as e:
                if "NoSuchBucket" not in str(e):
                    raise
        make = (
            f"gcloud storage buckets create gs://{name}"
            if gs
            else f"aws s3 mb s3://{name}"
        )
        raise ObjectStoreError(
            f"The {self.where} does not exist (reaching {path}). Correct the "
            f"bucket's name, or create the bucket (`{make}`) before saving to it."
        )

    def wrap(
        self, error: BaseException, path: Any, what: str = "Saving to"
    ) -> BaseException:
        """An error of the libraries Orbax reaches stores through (s3fs, gcsfs,
        botocore: raw, or as the cause of a builtin one) as an
        `ObjectStoreError` that says what to set; others, and an answer that
        an object is not there (a deletion, or damage), as they are."""
        seen: set[int] = set()
        at: BaseException | None = error
        while at is not None and id(at) not in seen and len(seen) < 16:
            seen.add(id(at))
            if type(at).__module__.split(".")[0] in _FSSPEC:
                if _says_missing(at):
                    return error
                return self.failed(what, path, f"{type(at).__name__}: {at}")
            at = at.__cause__ or at.__context__
        return error

    def delete(self, path: Any) -> None:
        key = self._key(path)
        first = _parts.part_name(key, 0)[: -len("00000")]  # `{key}.part-`
        last = first[:-1] + chr(ord(first[-1]) + 1)
        for lo, hi in ((key, key + "\0"), (first, last)):
            request = self._kv.delete_range(ts.KvStore.KeyRange(lo, hi))
            self.result(request, "Deleting", path)

    def listing(self, directory: Any, depth: int) -> list[str]:
        key = self._key(directory)  # "" for a bucket's root: every key is under it
        prefix, end = (f"{key}/", f"{key}0") if key else ("", "")  # ("0" follows "/")
        if self.where.scheme == "gs":
            keys = self._gcs_keys(prefix, directory)
        else:
            listed = self._kv.list(ts.KvStore.KeyRange(prefix, end), len(prefix))
            keys = [k.decode() for k in self.result(listed, "Listing", directory)]
        names = {_parts.whole_name(k) for k in keys}
        return sorted(n for n in names if n.count("/") < depth)

    def _gcs_keys(self, prefix: str, directory: Any) -> list[str]:
        """The keys under `prefix` (without it), listed through gcsfs, which
        raises for a page the store refused: TensorStore's gcs driver takes
        such a page (a 4xx answer) for the last one, and the listing for
        whole. A listing decides which shared packs a save deletes."""
        try:
            import gcsfs  # (the `gcs` extra, which Orbax needs on gs://)

            fs = gcsfs.GCSFileSystem(endpoint_url=self.where.endpoint)
            found = fs.find(f"{self.where.bucket}/{prefix}")
        except Exception as e:
            raise self.failed("Listing", directory, f"{type(e).__name__}: {e}") from e
        start = len(self.where.bucket) + 1 + len(prefix)
        return [name[start:] for name in found if len(name) > start]


def _says_missing(error: BaseException) -> bool:
    """Whether a library's error says an object (not its bucket) is not there."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("NoSuchKey", "NotFound", "404") or (
            status == 404 and code != "NoSuchBucket"
        )
    return getattr(error, "code", None) == 404  # gcsfs's HttpError


def _gcs_bucket_exists(bucket: str) -> bool:
    """gcsfs (which Orbax reaches gs:// through) tells a missing bucket."""
    try:
        import gcsfs  # noqa: F401  (the `gcs` extra)
        from etils import epath

        return epath.Path(f"gs://{bucket}").exists()
    except Exception:  # no gcsfs, or no answer: the requests after this say why
        return True


class ObjectReader(Reader):
    """Objects (one, or a file's parts) of `store`, read in pieces, each
    pinned to the generation `open` found (`pins`: {key: generation})."""

    def __init__(self, store: ObjectStore, path: Any, pins: dict[str, Any]):
        self._store, self._path, self._keys = store, path, list(pins)
        self._pins = pins

    def identity(self) -> Any:
        return tuple(self._pins.values())

    def start(
        self, ranges: Sequence[tuple[int, int]], buffers: Sequence[np.ndarray]
    ) -> Reads:
        jobs = []
        for i, ((start, stop), buf) in enumerate(zip(ranges, buffers, strict=True)):
            at = 0
            where = (
                [(0, start, stop)]
                if len(self._keys) == 1
                else _parts.pieces(start, stop)
            )
            for k, a, z in where:
                for piece in range(a, z, _PIECE):
                    n = min(_PIECE, z - piece)
                    job = functools.partial(
                        self._fill, buf[at : at + n], k, piece, start + at + n
                    )
                    jobs.append((i, at + n, job))
                    at += n
        return Reads(jobs, _WINDOW)

    def _fill(self, into: np.ndarray, k: int, a: int, end: int) -> None:
        key = self._keys[k]
        got = self._store.read(key, self._path, a, a + into.size)
        if got == "short":
            raise BadFile(f"ends before byte {end}")
        if got.state == "missing":
            raise BadFile("is missing")
        if got.stamp.generation != self._pins[key]:
            raise BadFile(
                "was replaced during the read (its generation changed after the "
                "first bytes were read)"
            )
        into[:] = np.frombuffer(got.value, np.uint8)

    def check_unchanged(self) -> None:
        for key, pin in self._pins.items():
            if self._store.probe(key, self._path, -1) != pin:
                raise BadFile("was replaced during the read")


def _cut(views: Iterable[memoryview], size: int) -> Iterable[memoryview]:
    """The views, split where they cross a multiple of `size` bytes."""
    at = 0
    for view in views:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        while view.nbytes:
            head, view = view[: size - at % size], view[size - at % size :]
            at += head.nbytes
            yield head


_Value = collections.namedtuple("_Value", "value state stamp")  # a ReadResult


@functools.lru_cache(maxsize=64)
def _store(where: Where) -> ObjectStore:
    return ObjectStore(where)


def store_for(url: str) -> ObjectStore:
    """The store of the bucket `url` is in, reached as the environment says now."""
    _stall_s()  # refused before any request if it is no time
    return _store(split(url)[0])
