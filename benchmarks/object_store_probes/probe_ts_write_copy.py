"""Probe: does KvStore.write copy its bytes? Peak RSS after writing 256 MiB.

Writes 8 x 32 MiB `bytes` to moto_server through TensorStore, then reports
ru_maxrss before and after: growth of ~256 MiB means TensorStore copies the
value (into its own buffer) rather than holding a reference to the bytes.
Run: PYTHONPATH=. python probes/probe_ts_write_copy.py
"""

import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

CODE = """
import resource, numpy as np, tensorstore as ts, os, sys
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
rng = np.random.default_rng(0)
blobs = [rng.bytes(32 << 20) for _ in range(8)]
kv = ts.KvStore.open({"driver": "s3", "bucket": "bkt",
    "endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_region": "us-east-1"}).result()
kv.write("warm", b"x").result()
before = rss()
futures = [kv.write(f"o{i}", b) for i, b in enumerate(blobs)]
for f in futures: f.result()
print("concurrent: peak RSS before", before, "MiB, after writes", rss(), "MiB")
"""

SEQ = CODE.replace(
    """futures = [kv.write(f"o{i}", b) for i, b in enumerate(blobs)]
for f in futures: f.result()
print("concurrent""",
    """for i, b in enumerate(blobs): kv.write(f"o{i}", b).result()
print("one at a time""",
)

if __name__ == "__main__":
    import _servers

    s3, _ = _servers.start()
    s3.create_bucket("bkt")
    env = dict(os.environ)
    for k, v in s3.env().items():
        env.pop(k, None) if v is None else env.__setitem__(k, v)
    for code in (CODE, SEQ):
        p = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(p.stdout.strip() or p.stderr[-800:])
    del resource
