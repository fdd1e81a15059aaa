"""Probe: how long a TensorStore read against a closed port takes to fail,
with the default retry settings and with fewer retries at default delays.

Each case is its own process, all running at once, printing as soon as its
read returns. Run: PYTHONPATH=. python probes/probe_closed_port.py
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _servers  # noqa: E402

from integration_tests._object_servers import env, free_port  # noqa: E402

LIMIT = 1500
CODE = """
import json, sys, time, tensorstore as ts
kv = ts.KvStore.open(json.loads(sys.argv[1])).result()
t = time.monotonic()
try:
    kv.read("k").result()
    print("read OK?!")
except Exception as e:
    print(f"failed after {time.monotonic() - t:.1f} s:", type(e).__name__,
          str(e)[:200])
"""


def main():
    s3, gcs = _servers.start()
    closed = f"http://127.0.0.1:{free_port()}"
    full = dict(os.environ)
    for k, v in env(s3, gcs).items():
        full.pop(k, None) if v is None else full.__setitem__(k, v)
    full["TENSORSTORE_GCS_HTTP_URL"] = closed
    s3spec = {"driver": "s3", "bucket": "bkt", "endpoint": closed, "aws_region": "x"}
    gspec = {"driver": "gcs", "bucket": "bkt"}
    cases = {
        "s3 defaults": s3spec,
        "gcs defaults": gspec,
        "s3 max_retries 5": s3spec
        | {"context": {"s3_request_retries": {"max_retries": 5}}},
        "gcs max_retries 5": gspec
        | {"context": {"gcs_request_retries": {"max_retries": 5}}},
        "s3 max_retries 8": s3spec
        | {"context": {"s3_request_retries": {"max_retries": 8}}},
    }
    procs = {
        label: subprocess.Popen(
            [sys.executable, "-c", CODE, json.dumps(spec)],
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for label, spec in cases.items()
    }
    t0 = time.monotonic()
    while procs and time.monotonic() - t0 < LIMIT:
        for label, p in list(procs.items()):
            if p.poll() is not None:
                out = p.stdout.read().strip().splitlines()
                print(f"{label}: {out[-3:]}", flush=True)
                del procs[label]
        time.sleep(0.5)
    for label, p in procs.items():
        p.kill()
        print(f"{label}: no answer after {LIMIT} s (killed)", flush=True)


if __name__ == "__main__":
    main()
