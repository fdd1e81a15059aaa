"""Which object-store client the byte layer uses: TensorStore's kvstore or obstore.

    pip install "obstore>=0.12,<0.13"   # the contender; not a dependency
    python benchmarks/object_clients.py [--mib 256] [--repeats 3] [--stall 2]

Starts moto_server (S3) and fake-gcs-server (GCS) on 127.0.0.1
(`integration_tests/_object_servers.py`) and measures each client on each
store in a fresh process (TensorStore reads its settings from the
environment once per process), with the retry settings the byte layer
would give it (6 retries, backoff 0.2 s doubling to 4 s, `--stall` seconds
without progress abandons a request):

- write: `--mib` MiB as 32 MiB objects, 4 requests in flight; MiB/s;
- ranged read: the same bytes as 8 MiB ranges into one numpy buffer, 4 in
  flight; MiB/s (median of `--repeats`);
- each fault class of `integration_tests/_faults.py`, on one ranged read of
  4 MiB through the fault proxy: seconds until the right bytes came
  ("ok"), or the error came, or a wrong answer was taken ("WRONG BYTES").

TensorStore's gcs driver reaches an emulator only through
`TENSORSTORE_GCS_HTTP_URL` and detects stalls only through
`TENSORSTORE_CURL_LOW_SPEED_*`, both environment variables: they are set for
its process here. obstore's GCS client uploads through the XML API, which
fake-gcs-server does not serve: its GCS objects are written with TensorStore.
A benchmark, not a test: it prints one table.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from integration_tests import _object_servers  # noqa: E402
from integration_tests._faults import Fault, FaultProxy  # noqa: E402

MiB = 1 << 20
OBJECT, PIECE, FLIGHT = 32 * MiB, 8 * MiB, 4
FAULTS = {  # (what, fault): what the fault proxy does to the ranged read
    "cut once": lambda: Fault("cut", method="GET", ranged=True, nth=[1], at=1000),
    "reset once": lambda: Fault("reset", method="GET", ranged=True, nth=[1]),
    "503 x3": lambda: Fault("status", method="GET", ranged=True, nth=[1, 2, 3]),
    "stalled body once": lambda: Fault(
        "stall_body", method="GET", ranged=True, nth=[1], at=1000
    ),
    "Range ignored": lambda: Fault("ignore_range", method="GET", ranged=True),
    "other range once": lambda: Fault(
        "shift_range", method="GET", ranged=True, nth=[1], at=4096
    ),
    "503 storm": lambda: Fault("status", status=503),
    "500 storm": lambda: Fault("status", status=500),
    "stall": lambda: Fault("stall", method="GET", ranged=True),
}


class TensorStore:
    def __init__(self, store, bucket, url, stall):
        import tensorstore as ts

        retries = {"max_retries": 6, "initial_delay": "0.2s", "max_delay": "4s"}
        spec = {"driver": store, "bucket": bucket}
        key = "gcs_request_retries" if store == "gcs" else "s3_request_retries"
        spec["context"] = {key: retries}
        if store == "s3":
            spec |= {"endpoint": url, "aws_region": "us-east-1"}
            spec["aws_credentials"] = {"type": "environment"}
        self.kv = ts.KvStore.open(spec).result()
        self.wait = 2 * stall + 10.2 + 5  # what the byte layer waited at most

    def put(self, key, data):
        self.kv.write(key, data).result(timeout=self.wait)

    def get_range(self, key, a, b):
        return self.kv.read(key, byte_range=slice(a, b)).result(timeout=self.wait).value


class Obstore:
    def __init__(self, store, bucket, url, stall):
        from obstore.store import GCSStore, S3Store

        s = datetime.timedelta(seconds=1)
        retry = {
            "max_retries": 6,
            "backoff": {"init_backoff": s / 5, "max_backoff": 4 * s},
        }
        client = {"allow_http": True, "connect_timeout": stall * s}
        client |= {"read_timeout": stall * s, "timeout": 3600 * s}
        if store == "s3":
            config = {"endpoint": url, "access_key_id": "testing"}
            config |= {"secret_access_key": "testing", "region": "us-east-1"}
            self.store = S3Store(
                bucket, config=config, client_options=client, retry_config=retry
            )
        else:
            account = {"gcs_base_url": url, "disable_oauth": True, "client_email": ""}
            account |= {"private_key": "", "private_key_id": ""}
            config = {"service_account_key": json.dumps(account)}
            self.store = GCSStore(
                bucket, config=config, client_options=client, retry_config=retry
            )

    def put(self, key, data):
        import obstore

        obstore.put(self.store, key, data)

    def get_range(self, key, a, b):
        import obstore

        return obstore.get_range(self.store, key, start=a, end=b)


def _said(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:60]}"


def _median_rate(call, nbytes, repeats):
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return nbytes / MiB / statistics.median(times)


def one(args) -> dict:
    """This process's case: `args.client` on `args.store`; returns the figures."""
    import numpy as np

    kind = {"tensorstore": TensorStore, "obstore": Obstore}[args.client]
    data = np.random.default_rng(0).integers(0, 256, args.mib * MiB, np.uint8)
    keys = [f"bench/{i}" for i in range(args.mib * MiB // OBJECT)]
    if args.fault:
        return {args.fault: _fault(args, kind, keys[0], data[: 4 * MiB].tobytes())}
    out: dict = {}
    writer = TensorStore if (args.client, args.store) == ("obstore", "gcs") else kind
    w = writer(args.store, args.bucket, args.url, args.stall)
    pool = concurrent.futures.ThreadPoolExecutor(FLIGHT)

    def write():
        views = [
            data[i * OBJECT : (i + 1) * OBJECT].tobytes() for i in range(len(keys))
        ]
        list(pool.map(w.put, keys, views))

    rate = _median_rate(write, data.nbytes, args.repeats)
    out["write"] = rate if writer is kind else "fails: 400 invalid uploadType"
    r = kind(args.store, args.bucket, args.url, args.stall)
    into = np.empty_like(data)

    def piece(at):
        key, a = keys[at // OBJECT], at % OBJECT
        into[at : at + PIECE] = np.frombuffer(r.get_range(key, a, a + PIECE), np.uint8)

    def read():
        list(pool.map(piece, range(0, data.nbytes, PIECE)))

    out["read"] = _median_rate(read, data.nbytes, args.repeats)
    assert (into == data).all()
    return out


def _fault(args, kind, key, want) -> tuple[float, str]:
    """One ranged read of `key` through the fault proxy with fault `args.fault`."""
    with FaultProxy(args.url, [FAULTS[args.fault]()]) as proxy:
        if args.store == "gcs":  # TensorStore's gcs driver reads it once, here
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = proxy.url
        c = kind(args.store, args.bucket, proxy.url, args.stall)
        began = time.perf_counter()
        try:
            got = bytes(c.get_range(key, 0, len(want)))
            outcome = "ok" if got == want else "WRONG BYTES"
        except Exception as e:  # what is measured
            outcome = _said(e)
        return time.perf_counter() - began, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stall", type=float, default=2.0)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # store,client,bucket,url
    parser.add_argument("--fault", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        args.store, args.client, args.bucket, args.url = args.case.split(",")
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    cases = [("s3", "obstore"), ("s3", "tensorstore")]
    cases += [("gcs", "tensorstore"), ("gcs", "obstore")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="oeqx-clients-") as logs:
        with (
            _object_servers.start_s3(logs) as s3,
            _object_servers.start_gcs(logs) as gcs,
        ):
            for store, client in cases:
                server = s3 if store == "s3" else gcs
                bucket = server.create_bucket(f"clients-{uuid.uuid4().hex[:12]}")
                env = {**os.environ}
                env |= {k: v for k, v in server.env().items() if v is not None}
                # Endpoints go in each client's settings (obstore 0.12 lets
                # AWS_ENDPOINT_URL_S3 override its `endpoint`: measured).
                for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
                    env.pop(name, None)
                env["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] = str(int(args.stall))
                env["TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"] = "1"
                case = f"{store},{client},{bucket.split('://')[1]},{server.url}"
                results[store, client] = {}
                for fault in [None, *FAULTS]:  # a process each: see the docstring
                    results[store, client] |= _child(args, case, fault, env)
                print(store, client, results[store, client], flush=True)
    _print(results, args)


def _child(args, case, fault, env) -> dict:
    argv = [sys.executable, __file__, f"--mib={args.mib}", f"--case={case}"]
    argv += [f"--repeats={args.repeats}", f"--stall={args.stall}"]
    argv += [f"--fault={fault}"] if fault else []
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    lines = [s for s in run.stdout.splitlines() if s.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{case} {fault} failed:\n{run.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _print(results, args) -> None:
    cols = [f"{store} {client}" for store, client in results]
    print(f"\n{args.mib} MiB, medians of {args.repeats}; stall {args.stall:g} s\n")
    print("| | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")

    def rate(v):
        return f"{v:.0f} MiB/s" if isinstance(v, float) else str(v or "n/a")

    for row in ("write", "read"):
        label = "write MiB/s" if row == "write" else "ranged read MiB/s"
        print(
            f"| {label} | " + " | ".join(rate(r[row]) for r in results.values()) + " |"
        )
    for name in FAULTS:
        cells = [f"{r[name][0]:.2f} s {r[name][1]}" for r in results.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
