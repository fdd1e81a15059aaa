"""A loopback HTTP proxy in front of an object-store server that injects faults.

It forwards every request to the real server (moto_server, fake-gcs-server)
and changes what chosen requests get back, the way a failing network, store
or caching proxy would:

- `"status"`: answers itself with an HTTP error (`status`, 503 by default)
  and a body in the store's error format (S3's XML, GCS's JSON);
- `"cut"`: sends the whole answer's headers, then `at` bytes of its body,
  then closes the connection (a body cut short);
- `"flip"`: sends the answer with the byte at `at` of its body changed;
- `"ignore_range"`: forwards the request without its `Range:` header, so the
  server answers 200 with the whole object (an endpoint or caching proxy
  that ignores ranges);
- `"shift_range"`: forwards the request with its `Range:` moved `at` bytes
  on, so the server answers 206 with other bytes than asked (and says so in
  its `Content-Range`);
- `"stall"`: answers nothing for `seconds` (the request hangs), then closes;
- `"stall_body"`: sends the headers and `at` bytes of the body, then stalls;
- `"reset"`: closes the connection at once with a TCP reset, answering nothing;
- `"call"`: runs `action()` (e.g. deletes objects behind the client's back),
  then forwards the request.

A `Fault` chooses its requests by method, by a regular expression searched in
the request's path and query (URL-decoded), by whether it has a `Range:`
header and one searched in its value, and by their number among the
requests it matches (`nth`, from 1; `every`: every n-th). Counting is per
fault and under a lock, so a test that makes the same requests gets the same
faults. `hits` counts the requests a
fault changed; `requests` logs every request the proxy saw.

Stdlib only. `close()` ends stalls at once.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import re
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable, Iterable

KINDS = (
    "status",
    "cut",
    "flip",
    "ignore_range",
    "shift_range",
    "stall",
    "stall_body",
    "reset",
    "call",
)
UPSTREAM_TIMEOUT = 60.0  # s: the real server answers well within this
_HOP = ("transfer-encoding", "connection", "content-length", "keep-alive")


@dataclasses.dataclass
class Fault:
    """What to do to which requests (see the module's doc)."""

    kind: str
    method: str | None = None  # "GET", "PUT", ...; None: any
    path: str | None = None  # regex searched in the decoded path and query
    nth: Iterable[int] | None = None  # which matching requests (from 1)
    every: int | None = None  # or every n-th matching request
    ranged: bool | None = None  # only requests with (True) or without a Range
    range: str | None = None  # regex searched in the Range header's value
    status: int = 503
    at: int | tuple[int, ...] = 0  # byte of the body where a cut, flip or
    # stall happens; a tuple: one after the other, per request changed
    seconds: float = 3600.0  # how long a stall lasts (close() ends it)
    action: Callable[[], None] | None = None  # for "call"
    seen: int = 0  # requests matched so far
    hits: int = 0  # requests changed so far

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        self.nth = None if self.nth is None else frozenset(self.nth)

    def _matches(self, method: str, target: str, asked: str | None) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.ranged is not None and (asked is not None) != self.ranged:
            return False
        if self.range is not None and not re.search(self.range, asked or ""):
            return False
        return self.path is None or re.search(self.path, target) is not None

    def offset(self) -> int:
        """Where this fault's latest change happens in the body."""
        if isinstance(self.at, int):
            return self.at
        return self.at[(self.hits - 1) % len(self.at)]

    def _chosen(self) -> bool:
        """Counts a matching request; whether this one gets the fault."""
        self.seen += 1
        if self.nth is not None:
            chosen = self.seen in self.nth
        elif self.every is not None:
            chosen = self.seen % self.every == 0
        else:
            chosen = True
        self.hits += chosen
        return chosen


@dataclasses.dataclass(frozen=True)
class Seen:
    """One request the proxy received, and what it did to it."""

    method: str
    target: str  # the decoded path and query
    range: str | None
    fault: str | None  # the kind applied, if any


class FaultProxy:
    """Runs the proxy in a thread; `.url` to point clients at.

    **Arguments:**

    - `upstream`: the real server's URL (`http://127.0.0.1:PORT`).
    - `faults`: the `Fault`s, tried in order; the first that chooses a
      request is applied to it (one fault a request). `add` adds more.
    """

    def __init__(self, upstream: str, faults: Iterable[Fault] = ()):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults = list(faults)
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                body = _read_body(self)
                target = urllib.parse.unquote(self.path)
                fault = owner._choose(self.command, target, self.headers.get("Range"))
                with owner._lock:
                    owner.requests.append(
                        Seen(
                            self.command,
                            target,
                            self.headers.get("Range"),
                            fault.kind if fault else None,
                        )
                    )
                owner._serve(self, body, fault)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that hung up on a fault: expected

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, fault: Fault) -> Fault:
        """Adds `fault` after the others; returns it (to read its `hits`)."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Removes every fault: from now on requests pass unchanged."""
        with self._lock:
            self.faults.clear()

    def _choose(self, method: str, target: str, asked: str | None) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault._matches(method, target, asked) and fault._chosen():
                    return fault
        return None

    # -- answering ------------------------------------------------------

    def _serve(self, handler, body: bytes, fault: Fault | None) -> None:
        kind = fault.kind if fault else None
        if kind == "reset":
            _reset(handler)
            return
        if kind == "stall":
            self._closing.wait(fault.seconds)
            _reset(handler)
            return
        if kind == "status":
            _answer_error(handler, fault.status)
            return
        if kind == "call":
            fault.action()
        headers = {
            k: v
            for k, v in handler.headers.items()
            if k.lower() not in ("transfer-encoding", "connection", "host")
        }
        headers["Host"] = self.upstream.netloc  # fake-gcs-server routes by it
        if kind == "ignore_range":
            headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        if kind == "shift_range":
            headers = {
                k: _shifted(v, fault.offset()) if k.lower() == "range" else v
                for k, v in headers.items()
            }
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(
            self.upstream.hostname, self.upstream.port, timeout=UPSTREAM_TIMEOUT
        )
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            status, answer = response.status, response.getheaders()
        finally:
            conn.close()
        at = fault.offset() if fault else 0
        if kind == "flip" and at < len(data):
            data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
        handler.send_response(status)
        for k, v in answer:
            if k.lower() not in _HOP:
                handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command == "HEAD":
            return
        if kind == "cut":
            handler.wfile.write(data[:at])
            handler.wfile.flush()
            _hang_up(handler)
            return
        if kind == "stall_body":
            handler.wfile.write(data[:at])
            handler.wfile.flush()
            self._closing.wait(fault.seconds)
            _reset(handler)
            return
        handler.wfile.write(data)

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shifted(asked: str, by: int) -> str:
    """`bytes=A-B` as `bytes=(A+by)-(B+by)`."""
    first, last = asked.split("=", 1)[1].split("-")
    return f"bytes={int(first) + by}-{int(last) + by}"


def _read_body(handler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0], 16)
            if not size:
                handler.rfile.readline()
                return b"".join(parts)
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length", 0)))


def _answer_error(handler, status: int) -> None:
    reason = http.client.responses.get(status, "Error")
    if handler.path.startswith(("/storage/", "/upload/", "/download/")):  # GCS
        body = json.dumps(
            {"error": {"code": status, "message": f"{reason} (injected)"}}
        ).encode()
        kind = "application/json"
    else:  # S3
        code = {503: "SlowDown", 500: "InternalError"}.get(status, reason)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error>'
            f"<Code>{code}</Code><Message>{reason} (injected)</Message></Error>"
        ).encode()
        kind = "application/xml"
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


def _hang_up(handler) -> None:
    """Closes the connection in order (a FIN): the answer simply ends early."""
    handler.close_connection = True
    try:
        handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reset(handler) -> None:
    """Closes the connection with a TCP reset (SO_LINGER 0), not a FIN."""
    handler.close_connection = True
    try:
        handler.connection.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        handler.connection.close()
    except OSError:
        pass
