"""Worker for test_store_faults.py: requests that stall, on gs:// or s3://.

    python _stall_worker.py STORE URL    # s3 s3://bucket, or gcs gs://bucket

The store's environment comes from the test (`AWS_ENDPOINT_URL`, or
`STORAGE_EMULATOR_HOST`), with `ORBAX_EQX_STALL_SECONDS` set short. In a
process of its own because TensorStore reads its stall setting once, at its
first request. A fault proxy of this process goes between orbax_eqx and the
server; each case stalls some requests for good and times the error:

- `get`: every GET of a pack's data answers nothing;
- `body`: every GET of a pack's data sends its headers and 100 bytes, then
  nothing;
- `put`: every upload of a pack is taken, and never answered;
- `latest`: three kept steps, every GET of a pack's data stalls:
  `restore_latest`.

Prints one `RESULT {json}` line a case, then `ok`.
"""

import json
import os
import sys
import time

from _worker import start

args = start("store", "url")

import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from _faults import Fault, FaultProxy  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

S3 = args.url.startswith("s3://")
UPSTREAM = os.environ["AWS_ENDPOINT_URL" if S3 else "STORAGE_EMULATOR_HOST"]
NAMES = (
    ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    if S3
    else ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
)
COMMIT_FILE = ocp.path.atomicity.CommitFileTemporaryPath


def tree(step: int) -> dict:
    return {"w": jnp.full((4096,), float(step)), "b": jnp.arange(64.0) + step}


def through(proxy: FaultProxy) -> None:
    for name in NAMES:
        os.environ[name] = proxy.url


def timed(call) -> dict:
    began = time.monotonic()
    try:
        call()
    except Exception as e:  # what the test judges
        return {
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
            "seconds": time.monotonic() - began,
        }
    return {"type": None, "seconds": time.monotonic() - began}


def report(case: str, result: dict, proxy: FaultProxy) -> None:
    result["case"] = case
    result["stalled"] = [r.target for r in proxy.requests if r.fault]
    print("RESULT " + json.dumps(result), flush=True)


def restore_stalled(case: str, fault: Fault) -> None:
    path = f"{args.url}/{case}"
    oeqx.save(path, tree(1))  # straight to the server
    with FaultProxy(UPSTREAM, [fault]) as proxy:
        through(proxy)
        result = timed(lambda: oeqx.restore(path, tree(0)))
    for name in NAMES:
        os.environ[name] = UPSTREAM
    report(case, result, proxy)


def save_stalled() -> None:
    upload = "PUT" if S3 else "POST"  # GCS: a media upload
    with FaultProxy(UPSTREAM, [Fault("stall", method=upload, path="packed")]) as proxy:
        through(proxy)
        result = timed(lambda: oeqx.save(f"{args.url}/put", tree(1)))
    for name in NAMES:
        os.environ[name] = UPSTREAM
    report("put", result, proxy)


def latest_stalled() -> None:
    root = f"{args.url}/latest"
    options = ocp.CheckpointManagerOptions(temporary_path_class=COMMIT_FILE)
    with ocp.CheckpointManager(
        root, item_handlers=oeqx.EqxHandler(), options=options
    ) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, args=oeqx.EqxSave(tree(step)))
        mngr.wait_until_finished()
    with FaultProxy(UPSTREAM) as proxy:
        through(proxy)
        with ocp.CheckpointManager(
            root, item_handlers=oeqx.EqxHandler(), options=options
        ) as mngr:
            proxy.add(Fault("stall", **DATA))
            result = timed(lambda: oeqx.restore_latest(mngr, oeqx.EqxRestore(tree(0))))
            proxy.clear()
    for name in NAMES:
        os.environ[name] = UPSTREAM
    report("latest", result, proxy)


# The reads of a pack's data (not the small reads that check its length).
DATA = {"method": "GET", "path": "packed", "range": "^bytes=0-"}
restore_stalled("get", Fault("stall", **DATA))
restore_stalled("body", Fault("stall_body", at=100, **DATA))
save_stalled()
latest_stalled()
print("ok", flush=True)
sys.exit(0)
