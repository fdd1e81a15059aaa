"""How long a failing object store takes to be an error, and what a transient
fault costs a restore that gets past it.

    python benchmarks/store_faults.py [--stores s3,gcs] [--cases get,put,...]

Starts moto_server and fake-gcs-server on 127.0.0.1, saves a small model
straight to each, then restores (or saves) it through the tests' fault proxy
(`integration_tests/_faults.py`) with one fault at a time, and prints the
seconds to the error (or to the restored model) beside a clean restore's.
The settings are this process's: `ORBAX_EQX_STALL_SECONDS` (default 60 s)
sets the stall cases. A benchmark, not a test: it prints.

Cases: `get` (every data GET answers nothing), `body` (headers and 100 bytes,
then nothing), `put` (every pack upload taken, never answered), `503` and
`500` (every request), `down` (nothing listens), `reset` (every data GET
reset), `cut` and `flip` (the first data GET cut short, one byte changed:
read again, restored).
"""

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax.numpy as jnp  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from integration_tests import _object_servers  # noqa: E402
from integration_tests._faults import Fault, FaultProxy  # noqa: E402

CASES = ("cut", "flip", "reset", "503", "500", "down", "get", "body", "put")
DATA = {"method": "GET", "path": "packed", "range": "^bytes=0-"}
NAMES = {
    "s3": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"),
    "gcs": ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"),
}


def tree(step: int) -> dict:
    return {"w": jnp.full((1 << 16,), float(step)), "b": jnp.arange(256.0) + step}


def fault(case: str) -> Fault | None:
    return {
        "cut": Fault("cut", nth=[1], at=100, **DATA),
        "flip": Fault("flip", nth=[1], at=100, **DATA),
        "reset": Fault("reset", **DATA),
        "503": Fault("status", status=503),
        "500": Fault("status", status=500),
        "get": Fault("stall", **DATA),
        "body": Fault("stall_body", at=100, **DATA),
    }.get(case)


def timed(call) -> tuple[float, str]:
    began = time.perf_counter()
    try:
        call()
        outcome = "restored"
    except Exception as e:  # what is measured
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"
    return time.perf_counter() - began, outcome


def run(store: str, server, cases: list[str]) -> None:
    url = server.create_bucket(f"faults-{store}-{os.getpid()}")
    path = f"{url}/m"
    with _object_servers.environ(server.env()):
        _object_servers.clear_fsspec_caches()
        oeqx.save(path, tree(1))
        upstream = os.environ[NAMES[store][0]]
        clean = None
        for case in ("clean", *cases):
            with FaultProxy(upstream) as proxy:
                with _object_servers.environ({n: proxy.url for n in NAMES[store]}):
                    _object_servers.clear_fsspec_caches()
                    if case == "down":
                        proxy.close()
                    if case == "put":
                        upload = "PUT" if store == "s3" else "POST"
                        proxy.add(Fault("stall", method=upload, path="packed"))
                        call = lambda: oeqx.save(f"{url}/put", tree(2))  # noqa: E731
                    else:
                        made = fault(case)
                        if made is not None:
                            proxy.add(made)
                        call = lambda: oeqx.restore(path, tree(0))  # noqa: E731
                    seconds, outcome = timed(call)
            if case == "clean":
                clean = seconds
            ratio = f"{seconds / clean:8.1f}x" if clean else ""
            print(f"{store:4} {case:6} {seconds:8.2f} s {ratio}  {outcome}", flush=True)
        _object_servers.clear_fsspec_caches()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="s3,gcs")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = args.cases.split(",")
    stall = os.environ.get("ORBAX_EQX_STALL_SECONDS", "60 (default)")
    print(f"ORBAX_EQX_STALL_SECONDS={stall}; seconds to the outcome, and x clean")
    with tempfile.TemporaryDirectory(prefix="oeqx-faults-") as logs:
        for store in args.stores.split(","):
            start = (
                _object_servers.start_s3 if store == "s3" else _object_servers.start_gcs
            )
            with start(logs) as server:
                run(store, server, cases)


if __name__ == "__main__":
    main()
