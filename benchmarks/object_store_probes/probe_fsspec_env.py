"""Probe: which environment variables epath's s3fs / gcsfs need, and what
leaving the others out costs (time to the first write + read, fresh process).

Run: PYTHONPATH=. python probes/probe_fsspec_env.py
"""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _servers  # noqa: E402

CODE = """
import os, time
t = time.monotonic()
from etils import epath
p = epath.Path(os.environ["PROBE_ROOT"]) / "x.txt"
p.write_text("hi")
assert p.read_text() == "hi"
print(f"ok in {time.monotonic() - t:.2f} s")
"""


def run(label, root, keep, server_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_"))}
    for k in ("STORAGE_EMULATOR_HOST", "NO_GCE_CHECK", "GCE_METADATA_HOST"):
        env.pop(k, None)
    env |= {k: v for k, v in server_env.items() if k in keep and v is not None}
    env["PROBE_ROOT"] = root
    t = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-c", CODE],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        out = p.stdout.strip() or p.stderr.strip().splitlines()[-1][:300]
    except subprocess.TimeoutExpired:
        out = "HANG > 90 s"
    print(f"{label}: {out} (process {time.monotonic() - t:.1f} s)", flush=True)


def main():
    s3, gcs = _servers.start()
    s3root, gsroot = s3.create_bucket("bkt"), gcs.create_bucket("bkt")
    s3env, gsenv = s3.env(), gcs.env()
    run("s3 full env()", s3root, set(s3env), s3env)
    run(
        "s3 AWS_ENDPOINT_URL + keys only",
        s3root,
        {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"},
        s3env,
    )
    run("s3 AWS_ENDPOINT_URL only (no keys)", s3root, {"AWS_ENDPOINT_URL"}, s3env)
    run("gs full env()", gsroot, set(gsenv), gsenv)
    run("gs STORAGE_EMULATOR_HOST only", gsroot, {"STORAGE_EMULATOR_HOST"}, gsenv)
    run(
        "gs STORAGE_EMULATOR_HOST + NO_GCE_CHECK",
        gsroot,
        {"STORAGE_EMULATOR_HOST", "NO_GCE_CHECK"},
        gsenv,
    )


if __name__ == "__main__":
    main()
