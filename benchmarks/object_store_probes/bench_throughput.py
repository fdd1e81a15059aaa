"""Probe: 256 MiB through each client to moto_server and fake-gcs-server.

Writes 8 x 32 MiB objects concurrently, then reads them back as 16 MiB ranged
reads, all concurrently, with TensorStore's kvstore, fsspec (s3fs / gcsfs
`pipe` and `cat_ranges`), boto3 (S3) and google-cloud-storage (GCS). Each case
runs in a fresh process, so its peak RSS (ru_maxrss) is its own; the payload
alone is 256 MiB written + 256 MiB read back. Client CPU seconds are printed
beside wall time: on a shared machine they are the steadier comparison. The
servers' peak RSS (VmHWM) is read at the end.

Run: PYTHONPATH=. python probes/bench_throughput.py [repeats]
"""

import json
import os
import resource
import subprocess
import sys
import time
import uuid

MIB = 1 << 20
OBJECTS, OBJECT_SIZE, READ_SIZE = 8, 32 * MIB, 16 * MIB
LIMIT = 300


def payload() -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.bytes(OBJECT_SIZE) for _ in range(OBJECTS)]


def ranges():
    for i in range(OBJECTS):
        for start in range(0, OBJECT_SIZE, READ_SIZE):
            yield i, start, start + READ_SIZE


def key(i):
    return f"bench/obj{i}.bin"


# --- clients: write(blobs), read() -> list of (i, start, bytes), cleanup() ---


def tensorstore_client(kind, url, bucket):
    import tensorstore as ts

    spec = {
        "driver": "s3",
        "bucket": bucket,
        "endpoint": url,
        "aws_region": "us-east-1",
    }
    if kind == "gcs":
        spec = {"driver": "gcs", "bucket": bucket}
    kv = ts.KvStore.open(spec).result()

    def write(blobs):
        for f in [kv.write(key(i), b) for i, b in enumerate(blobs)]:
            f.result()

    def read():
        futures = [
            (i, s, kv.read(key(i), byte_range=slice(s, e))) for i, s, e in ranges()
        ]
        return [(i, s, f.result().value) for i, s, f in futures]

    def cleanup():
        kv.delete_range(ts.KvStore.KeyRange("bench/", "bench0")).result()

    return write, read, cleanup


def fsspec_client(kind, url, bucket):
    import fsspec

    fs = fsspec.filesystem("s3" if kind == "s3" else "gcs")
    paths = [f"{bucket}/{key(i)}" for i in range(OBJECTS)]

    def write(blobs):
        fs.pipe(dict(zip(paths, blobs, strict=True)))

    def read():
        rs = list(ranges())
        got = fs.cat_ranges(
            [paths[i] for i, _, _ in rs], [s for _, s, _ in rs], [e for _, _, e in rs]
        )
        return [(i, s, g) for (i, s, _), g in zip(rs, got, strict=True)]

    def cleanup():
        fs.rm(paths)

    return write, read, cleanup


def boto3_client(kind, url, bucket):
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    s3 = boto3.client("s3")  # endpoint, keys, region from the environment
    pool = ThreadPoolExecutor(16)

    def write(blobs):
        list(
            pool.map(
                lambda ib: s3.put_object(Bucket=bucket, Key=key(ib[0]), Body=ib[1]),
                enumerate(blobs),
            )
        )

    def read():
        def get(r):
            i, s, e = r
            body = s3.get_object(Bucket=bucket, Key=key(i), Range=f"bytes={s}-{e - 1}")
            return i, s, body["Body"].read()

        return list(pool.map(get, ranges()))

    def cleanup():
        s3.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": key(i)} for i in range(OBJECTS)]}
        )

    return write, read, cleanup


def gcloud_client(kind, url, bucket):
    from concurrent.futures import ThreadPoolExecutor

    from google.cloud import storage

    # STORAGE_EMULATOR_HOST makes the client anonymous and points it there.
    b = storage.Client(project="test-project").bucket(bucket)
    pool = ThreadPoolExecutor(16)

    def write(blobs):
        list(
            pool.map(
                lambda ib: b.blob(key(ib[0])).upload_from_string(ib[1]),
                enumerate(blobs),
            )
        )

    def read():
        def get(r):
            i, s, e = r
            return i, s, b.blob(key(i)).download_as_bytes(start=s, end=e - 1)

        return list(pool.map(get, ranges()))

    def cleanup():
        for i in range(OBJECTS):
            b.blob(key(i)).delete()

    return write, read, cleanup


CLIENTS = {
    "tensorstore": tensorstore_client,
    "fsspec": fsspec_client,
    "boto3": boto3_client,
    "google-cloud-storage": gcloud_client,
}


def worker(client, kind, url, bucket):
    blobs = payload()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    write, read, cleanup = CLIENTS[client](kind, url, bucket)
    c0, t = cpu(), time.perf_counter()
    write(blobs)
    t_write, c_write = time.perf_counter() - t, cpu() - c0
    c0, t = cpu(), time.perf_counter()
    got = read()
    t_read, c_read = time.perf_counter() - t, cpu() - c0
    assert len(got) == OBJECTS * OBJECT_SIZE // READ_SIZE
    for i, s, data in got:
        assert bytes(data) == blobs[i][s : s + READ_SIZE], (i, s)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cleanup()
    total = OBJECTS * OBJECT_SIZE / MIB
    print(
        json.dumps(
            {
                "write_s": round(t_write, 2),
                "read_s": round(t_read, 2),
                "write_MiB_s": round(total / t_write),
                "read_MiB_s": round(total / t_read),
                "write_cpu_s": round(c_write, 2),
                "read_cpu_s": round(c_read, 2),
                "peak_rss_MiB": round(peak),
                "rss_before_io_MiB": round(rss0),
            }
        )
    )


def cpu():
    """This process's CPU seconds: the machine is shared, wall time is noisy."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def server_hwm(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) // 1024


def main(repeats):
    sys.path.insert(0, os.path.dirname(__file__))
    import _servers

    from integration_tests import _object_servers as osv

    s3, gcs = _servers.start("memory")
    _, gcs_fs = _servers.start("filesystem")
    cases = [(s3, c) for c in ("tensorstore", "fsspec", "boto3")]
    cases += [(gcs, c) for c in ("tensorstore", "fsspec", "google-cloud-storage")]
    cases += [(gcs_fs, c) for c in ("tensorstore", "fsspec")]
    for rep in range(repeats):
        for server, client in cases:
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            server.create_bucket(bucket)
            env = dict(os.environ)
            for k, v in server.env().items():
                env.pop(k, None) if v is None else env.__setitem__(k, v)
            label = f"{server.kind}{'-fs' if server is gcs_fs else ''} {client}"
            argv = [sys.executable, __file__, "--worker", client, server.kind]
            try:
                p = subprocess.run(
                    [*argv, server.url, bucket],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=LIMIT,
                )
                out = p.stdout.strip() or p.stderr.strip()[-800:]
            except subprocess.TimeoutExpired:
                out = f"HANG after {LIMIT} s"
            print(f"run {rep} {label:32} {out}", flush=True)
    del osv
    for name, server in [
        ("moto_server", s3),
        ("fake-gcs memory", gcs),
        ("fake-gcs filesystem", gcs_fs),
    ]:
        print(f"server peak RSS {name}: {server_hwm(server.proc.pid)} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:6])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
