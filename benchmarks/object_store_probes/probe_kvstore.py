"""Probe: which TensorStore kvstore specs reach moto_server / fake-gcs-server,
and what ranged reads, buffers, list, delete_range and failures look like.

Each case runs in a fresh process (TensorStore caches contexts, credentials
and connections per process) with a time limit, so a hang shows as a hang.
Run: PYTHONPATH=. python probes/probe_kvstore.py [label substrings]
"""

import json
import os
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(__file__))
import _servers  # noqa: E402

from integration_tests._object_servers import free_port  # noqa: E402

LIMIT = 25.0


def run(label, code, env, limit=LIMIT):
    if ONLY and ONLY != ["extra"] and not any(o in label for o in ONLY):
        return
    limit = float(os.environ.get("PROBE_LIMIT", limit))
    full = {**os.environ}
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    prelude = "import tensorstore as ts, numpy as np, time, json\n"
    t = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)],
            env=full,
            capture_output=True,
            text=True,
            timeout=limit,
        )
        out = p.stdout.strip() + (
            "" if p.returncode == 0 else f" [rc={p.returncode}] " + _err(p.stderr)
        )
    except subprocess.TimeoutExpired:
        out = f"HANG: no result after {limit:.0f} s (killed)"
    print(f"## {label}  ({time.monotonic() - t:.1f} s)\n   {out}", flush=True)


def _err(stderr):
    lines = [x for x in stderr.splitlines() if "AuthCredentialsProvider" not in x]
    return " | ".join(lines[-3:])[:600]


def main():
    s3, gcs = _servers.start()
    s3.create_bucket("bkt")
    gcs.create_bucket("bkt")
    s3env, gcsenv = s3.env(), gcs.env()
    no_aws = {k: None for k in s3env if k.startswith("AWS_")} | {
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    wr = """
    kv = ts.KvStore.open(SPEC).result()
    kv.write("a/x", b"hello world").result()
    r = kv.read("a/x").result()
    print("OK", r.state, bytes(r.value))
    """
    closed = f"http://127.0.0.1:{free_port()}"

    def s(spec, code=wr):
        return f"SPEC = {json.dumps(spec)}\n" + textwrap.dedent(code)

    S3 = {"driver": "s3", "bucket": "bkt", "endpoint": s3.url}
    G = {"driver": "gcs", "bucket": "bkt"}
    print("# Specs")
    run("s3 endpoint+aws_region, AWS_* env", s(S3 | {"aws_region": REGION}), s3env)
    run("s3 endpoint only, AWS_REGION env", s(S3), s3env)
    run(
        "s3 endpoint only, no region env",
        s(S3),
        s3env | {"AWS_REGION": None, "AWS_DEFAULT_REGION": None},
    )
    run(
        "s3 no endpoint, AWS_ENDPOINT_URL env",
        s({"driver": "s3", "bucket": "bkt"}),
        s3env,
        limit=30,
    )
    run("s3 URL 's3://bkt/', AWS_ENDPOINT_URL env", s("s3://bkt/"), s3env, limit=30)
    run("s3 endpoint, no AWS_* env at all (no credentials)", s(S3), no_aws)
    run(
        "s3 endpoint, aws_credentials anonymous, no AWS_* env",
        s(S3 | {"aws_credentials": {"type": "anonymous"}}),
        no_aws,
    )
    run(
        "s3 endpoint, aws_credentials environment",
        s(S3 | {"aws_credentials": {"type": "environment"}}),
        s3env,
    )
    run("gcs TENSORSTORE_GCS_HTTP_URL + token", s(G), gcsenv)
    run("gcs URL 'gs://bkt/'", s("gs://bkt/"), gcsenv)
    run(
        "gcs TENSORSTORE_GCS_HTTP_URL, no GOOGLE_AUTH_TOKEN_FOR_TESTING",
        s(G),
        gcsenv | {"GOOGLE_AUTH_TOKEN_FOR_TESTING": None},
        limit=60,
    )
    run(
        "gcs STORAGE_EMULATOR_HOST only",
        s(G),
        gcsenv | {"TENSORSTORE_GCS_HTTP_URL": None},
        limit=30,
    )

    print("\n# Ranged reads, buffers, list, delete_range")
    ops = """
    kv = ts.KvStore.open(SPEC).result()
    data = bytes(range(256)) * 4
    kv.write("r/obj", data).result()
    r = kv.read("r/obj", byte_range=slice(10, 20)).result()
    print("slice(10,20):", r.state, bytes(r.value) == data[10:20])
    r = kv.read("r/obj", byte_range=slice(1000, None)).result()
    print("slice(1000,None):", len(r.value), bytes(r.value) == data[1000:])
    for bad in (slice(1000, 2000), slice(2000, 3000)):
        try:
            r = kv.read("r/obj", byte_range=bad).result()
            print(bad, "->", r.state, len(r.value))
        except Exception as e:
            print(bad, "->", type(e).__name__, str(e)[:160])
    try:
        r = kv.read("r/none", byte_range=slice(0, 4)).result()
        print("missing key ranged ->", r.state)
    except Exception as e:
        print("missing key ranged ->", type(e).__name__, str(e)[:160])
    arr = np.arange(16, dtype=np.uint8)
    for name, v in [("memoryview", memoryview(arr)), ("numpy", arr),
                    ("bytearray", bytearray(b"xy"))]:
        try:
            kv.write("buf", v).result()
            print("write", name, "accepted; read back",
                  bytes(kv.read("buf").result().value)[:8])
        except Exception as e:
            print("write", name, "->", type(e).__name__, str(e)[:200])
    for k in ["p/a", "p/b/c", "p/b/d", "pz", "q/a"]:
        kv.write(k, b"1").result()
    print("list() all:", sorted(kv.list().result()))
    print("list prefix p/:", sorted(kv.list(ts.KvStore.KeyRange("p/", "p0")).result()))
    print("list p/ strip 2:", sorted(kv.list(ts.KvStore.KeyRange("p/", "p0"),
          strip_prefix_length=2).result()))
    sub = kv / "p/"
    print("(kv / 'p/').list():", sorted(sub.list().result()))
    try:
        print("(kv / 'p/').url:", sub.url)
    except Exception as e:
        print("(kv / 'p/').url ->", type(e).__name__, str(e)[:120])
    kv.delete_range(ts.KvStore.KeyRange("p/b/", "p/b0")).result()
    print("after delete_range p/b/:", sorted(kv.list().result()))
    sub.delete_range(ts.KvStore.KeyRange()).result()
    print("after (kv/'p/').delete_range(all):", sorted(kv.list().result()))
    t = time.monotonic(); kv.write("gone", None).result()
    print("delete missing key: ok", f"{time.monotonic()-t:.3f}s")
    t = time.monotonic(); kv.delete_range(ts.KvStore.KeyRange("zz/", "zz0")).result()
    print("delete_range of nothing: ok")
    g1 = kv.write("cond", b"1").result()
    g2 = kv.write("cond", b"2").result()
    r = kv.write("cond", b"3", if_equal=g1.generation).result()
    print("if_equal stale generation -> generation", r.generation,
          "value now", bytes(kv.read("cond").result().value))
    r = kv.write("new", b"1", if_equal=b"").result()
    print("if_equal b'' (create only) on new key ->", r.generation != b"")
    r = kv.write("new", b"2", if_equal=b"").result()
    print("if_equal b'' on existing key -> generation", r.generation,
          "value", bytes(kv.read("new").result().value))
    """
    run("s3 ops", s(S3 | {"aws_region": REGION}, ops), s3env)
    run("gcs ops", s(G, ops), gcsenv)

    print("\n# Failures")
    fail = """
    t = time.monotonic()
    try:
        kv = ts.KvStore.open(SPEC).result()
        print("open ok", f"{time.monotonic()-t:.2f}s")
        for op, f in [("read", lambda: kv.read("k").result().state),
                      ("write", lambda: kv.write("k", b"v").result()),
                      ("list", lambda: kv.list().result())]:
            t = time.monotonic()
            try:
                print(op, "returned", f(), f"{time.monotonic()-t:.2f}s")
            except Exception as e:
                print(op, "->", type(e).__name__, repr(str(e)[:300]),
                      f"{time.monotonic()-t:.2f}s")
    except Exception as e:
        print("open ->", type(e).__name__, repr(str(e)[:300]),
              f"{time.monotonic()-t:.2f}s")
    """
    fast_s3 = {
        "s3_request_retries": {
            "max_retries": 2,
            "initial_delay": "10ms",
            "max_delay": "50ms",
        }
    }
    fast_gcs = {
        "gcs_request_retries": {
            "max_retries": 2,
            "initial_delay": "10ms",
            "max_delay": "50ms",
        }
    }
    run(
        "s3 missing bucket",
        s(S3 | {"bucket": "nobucket", "aws_region": REGION}, fail),
        s3env,
    )
    run("gcs missing bucket", s(G | {"bucket": "nobucket"}, fail), gcsenv)
    run(
        "s3 closed port, defaults",
        s(S3 | {"endpoint": closed, "aws_region": REGION}, fail),
        s3env,
        limit=60,
    )
    run(
        "s3 closed port, context s3_request_retries max 2",
        s(S3 | {"endpoint": closed, "aws_region": REGION, "context": fast_s3}, fail),
        s3env,
    )
    run(
        "gcs closed port, defaults",
        s(G, fail),
        gcsenv | {"TENSORSTORE_GCS_HTTP_URL": closed},
        limit=60,
    )
    run(
        "gcs closed port, context gcs_request_retries max 2",
        s(G | {"context": fast_gcs}, fail),
        gcsenv | {"TENSORSTORE_GCS_HTTP_URL": closed},
    )
    run(
        "s3 closed port, no aws_region, retries max 2",
        s(S3 | {"endpoint": closed, "context": fast_s3}, fail),
        s3env | {"AWS_REGION": None, "AWS_DEFAULT_REGION": None},
    )


REGION = "us-east-1"
ONLY = sys.argv[1:]  # run only the cases whose label contains one of these


def extra():
    """Defaults as TensorStore resolves them, concurrency options, GCS auth."""
    s3, gcs = _servers.start()
    s3.create_bucket("bkt")
    gcs.create_bucket("bkt")
    show = """
    kv = ts.KvStore.open(SPEC).result()
    kv.write("k", b"v").result()
    j = kv.spec(retain_context=True).to_json(include_defaults=True)
    print(json.dumps(j.get("context", j), sort_keys=True))
    """
    ctx = {
        "s3_request_concurrency": {"limit": 8},
        "s3_request_retries": {"max_retries": 5},
    }
    spec = {"driver": "s3", "bucket": "bkt", "endpoint": s3.url, "context": ctx}
    run(
        "s3 resolved context (concurrency 8, retries 5)",
        f"SPEC = {json.dumps(spec)}\n" + textwrap.dedent(show),
        s3.env(),
    )
    ctx = {"gcs_request_concurrency": {"limit": 8}}
    spec = {"driver": "gcs", "bucket": "bkt", "context": ctx}
    run(
        "gcs resolved context (concurrency 8)",
        f"SPEC = {json.dumps(spec)}\n" + textwrap.dedent(show),
        gcs.env(),
    )
    bare = {k: None for k in gcs.env() if k not in ("TENSORSTORE_GCS_HTTP_URL",)}
    run(
        "gcs TENSORSTORE_GCS_HTTP_URL alone (no token, no GCE_* / NO_GCE_CHECK)",
        f"SPEC = {json.dumps({'driver': 'gcs', 'bucket': 'bkt'})}\n"
        + textwrap.dedent(show),
        bare,
        limit=60,
    )


if __name__ == "__main__":
    extra() if ONLY == ["extra"] else main()
