"""Which bucket, endpoint, region and credentials an object path means.

Nothing here is orbax_eqx's own configuration: each store is reached the way
its ecosystem's tools reach it, from the standard environment.

- `s3://bucket/key`: `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (an
  S3-compatible store: MinIO, R2, Ceph...; default AWS itself), `AWS_REGION`
  or `AWS_DEFAULT_REGION`, and credentials from `AWS_ACCESS_KEY_ID` /
  `AWS_SECRET_ACCESS_KEY` (`AWS_SESSION_TOKEN`), else the AWS default chain
  (`AWS_PROFILE` and `~/.aws`, instance metadata).
- `gs://bucket/key`: application default credentials
  (`GOOGLE_APPLICATION_CREDENTIALS`, `gcloud auth application-default
  login`, the metadata server); an emulator through `STORAGE_EMULATOR_HOST`
  (what gcsfs and Google's clients follow), or TensorStore's own
  `TENSORSTORE_GCS_HTTP_URL`.
"""

import dataclasses
import os
from typing import Any

from .._errors import OrbaxEqxError
from . import patience

CONCURRENCY = 32  # requests in flight to one store


class ObjectPathError(OrbaxEqxError, ValueError):
    """An object-store path orbax_eqx cannot use."""


@dataclasses.dataclass(frozen=True)
class Where:
    """One bucket of one store, and how to reach it."""

    scheme: str  # "gs" or "s3"
    bucket: str
    endpoint: str | None  # None: the store's own
    region: str | None
    credentials: str  # how they are found, for messages

    def spec(self) -> dict[str, Any]:
        """The TensorStore kvstore spec of the bucket's root."""
        if self.scheme == "gs":
            return {
                "driver": "gcs",
                "bucket": self.bucket,
                "context": {
                    "gcs_request_retries": patience.tensorstore_retries(),
                    "gcs_request_concurrency": {"limit": CONCURRENCY},
                },
            }
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": self.bucket,
            "aws_region": self.region or "us-east-1",
            "context": {
                "s3_request_retries": patience.tensorstore_retries(),
                "s3_request_concurrency": {"limit": CONCURRENCY},
            },
        }
        if self.endpoint:
            spec["endpoint"] = self.endpoint
        if self.credentials == "environment":
            # Read from the variables; the default chain would first parse
            # missing ~/.aws files and log an error line for each.
            spec["aws_credentials"] = {"type": "environment"}
        return spec

    def describe(self) -> str:
        """Where requests go, for messages."""
        if self.scheme == "gs":
            return (
                f"bucket {self.bucket!r} at {self.endpoint or 'Google Cloud Storage'}"
            )
        return f"bucket {self.bucket!r} at {self.endpoint or 'AWS S3'}"

    def setup_hint(self) -> str:
        """What to set to be let in, for messages of refused requests."""
        if self.scheme == "gs":
            return (
                "Check the bucket exists and your credentials reach it "
                "(GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth "
                "application-default login`); for an emulator set "
                "STORAGE_EMULATOR_HOST."
            )
        return (
            "Check the bucket exists and your credentials reach it "
            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE); for "
            "an S3-compatible store set AWS_ENDPOINT_URL, and AWS_REGION if it "
            "needs one."
        )

    def endpoint_hint(self) -> str:
        """What to check when nothing answers at the endpoint, for messages."""
        if self.scheme == "gs":
            return (
                "Check the store is up and reachable from here; for an emulator "
                "set STORAGE_EMULATOR_HOST to where it listens."
            )
        return (
            "Check the store is up and reachable from here; for an "
            "S3-compatible store set AWS_ENDPOINT_URL to where it listens."
        )


def split(url: str) -> tuple[Where, str]:
    """`s3://bucket/a/b` as `(where, "a/b")`."""
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
    return _where(scheme, bucket), key.strip("/")


def _where(scheme: str, bucket: str) -> Where:
    env = os.environ
    if scheme == "gs":
        emulator = env.get("STORAGE_EMULATOR_HOST")
        if emulator and not env.get("TENSORSTORE_GCS_HTTP_URL"):
            # TensorStore reads its own variable; gcsfs (Orbax's directories)
            # and Google's clients read this one: one setting for both.
            url = emulator if "://" in emulator else f"http://{emulator}"
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
            os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "owner")
        endpoint = env.get("TENSORSTORE_GCS_HTTP_URL")
        return Where("gs", bucket, endpoint, None, "default")
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    has_keys = env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")
    credentials = "environment" if has_keys else "default"
    return Where("s3", bucket, endpoint, region, credentials)
