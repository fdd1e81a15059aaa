"""Save and restore time on gs:// and s3://, against plain Orbax and raw transfers.

    python benchmarks/object_store.py [--repeats N] [--only a,b] [--stores gs,s3]
                                      [--json FILE]

Starts a loopback moto_server (S3) and fake-gcs-server (GCS, objects in
memory) itself (`integration_tests/_object_servers.py`), then, per model and
round, with contenders taking turns (A B C, then B C A, ...):

- gs://: `oeqx.save` / `oeqx.restore` against plain Orbax
  (`StandardCheckpointer` on `eqx.filter(model, eqx.is_array)`, restored with
  explicit shardings), on the same arrays;
- s3://, where plain Orbax cannot write: against a raw upload of the same
  bytes (the arrays' bytes end to end, as 64 MiB objects, 8 requests in
  flight, boto3) and its download; and against one object per array (boto3,
  16 requests in flight), the way a per-leaf store would do it; and
  orbax_eqx restoring without checking CRCs (`verify=False`), which shows
  what the checks cost against a raw download that checks nothing.

Every figure is a median over the rounds; ratios are of medians from this
run. Then, in fresh processes, the peak host memory of an orbax_eqx save and
restore of each model on each store, over the model's bytes.
"""

import argparse
import concurrent.futures
import gc
import json
import logging
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import uuid

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import _contenders  # noqa: E402
import _models  # noqa: E402
import boto3  # noqa: E402
import botocore.config  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from integration_tests import _object_servers  # noqa: E402

MiB = 2**20
PART = 64 * MiB


def _log(text):
    print(text, flush=True)


class OrbaxEqx:
    name = "orbax_eqx"

    def save(self, url, item):
        oeqx.save(url, item)

    def restore(self, url, skeleton):
        return oeqx.restore(url, skeleton)


class OrbaxEqxUnverified(OrbaxEqx):
    """Restores without checking CRCs: what the checks cost."""

    name = "orbax_eqx_unverified"

    def restore(self, url, skeleton):
        return oeqx.restore(url, skeleton, verify=False)


class Orbax(_contenders.Orbax):
    name = "orbax"


class _Boto:
    def __init__(self, server):
        self.server, self._client = server, None

    @property
    def s3(self):
        # Made on first use, inside the server's environment (its keys).
        if self._client is None:
            # A connection per thread of the baselines (16 at most): boto3's
            # default pool of 10 discarded connections ("Connection pool is
            # full" warnings) and slowed the baselines, not orbax_eqx.
            self._client = boto3.client(
                "s3",
                endpoint_url=self.server.url,
                region_name="us-east-1",
                config=botocore.config.Config(max_pool_connections=32),
            )
        return self._client

    @staticmethod
    def split(url):
        bucket, _, key = url.removeprefix("s3://").partition("/")
        return bucket, key


class RawObjects(_Boto):
    """The arrays' bytes end to end, as 64 MiB objects: what the network allows."""

    name = "raw"

    def save(self, url, item):
        bucket, key = self.split(url)
        data = b"".join(np.asarray(x).tobytes() for x in _models.array_leaves(item))
        self.sizes = len(data)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda i: self.s3.put_object(
                        Bucket=bucket,
                        Key=f"{key}/{i}",
                        Body=data[i * PART : (i + 1) * PART],
                    ),
                    range(-(-len(data) // PART)),
                )
            )

    def restore(self, url, skeleton):
        bucket, key = self.split(url)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            parts = list(
                pool.map(
                    lambda i: self.s3.get_object(Bucket=bucket, Key=f"{key}/{i}")[
                        "Body"
                    ].read(),
                    range(-(-self.sizes // PART)),
                )
            )
        data = np.frombuffer(b"".join(parts), np.uint8)
        out, at = [], 0
        for x in jax.tree_util.tree_leaves(skeleton):
            if isinstance(x, jax.ShapeDtypeStruct):
                n = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                out.append(
                    jax.device_put(data[at : at + n].view(x.dtype).reshape(x.shape))
                )
                at += n
        return out


class PerArray(_Boto):
    """One object per array, 16 requests in flight."""

    name = "per_array"

    def save(self, url, item):
        bucket, key = self.split(url)
        leaves = _models.array_leaves(item)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda ix: self.s3.put_object(
                        Bucket=bucket,
                        Key=f"{key}/{ix[0]}",
                        Body=np.asarray(ix[1]).tobytes(),
                    ),
                    enumerate(leaves),
                )
            )

    def restore(self, url, skeleton):
        bucket, key = self.split(url)
        structs = [
            x
            for x in jax.tree_util.tree_leaves(skeleton)
            if isinstance(x, jax.ShapeDtypeStruct)
        ]

        def get(ix):
            i, x = ix
            body = self.s3.get_object(Bucket=bucket, Key=f"{key}/{i}")["Body"].read()
            return jax.device_put(np.frombuffer(body, x.dtype).reshape(x.shape))

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            return list(pool.map(get, enumerate(structs)))


def _timed(fn, *args):
    gc.collect()
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def run_store(server, contenders, models, repeats):
    bucket = server.create_bucket(f"bench-{uuid.uuid4().hex[:12]}")
    results = {}
    with _object_servers.environ(server.env()):
        _object_servers.clear_fsspec_caches()
        for model in models:
            item, skeleton = _models.build(model), _models.skeleton(model)
            times = {c.name: {"save": [], "restore": []} for c in contenders}
            # A warm-up round, not counted: first requests open connections.
            order = list(contenders)
            for r in range(repeats + 1):
                for c in order:
                    url = f"{bucket}/{model}/{c.name}/{r}"
                    t_save, _ = _timed(c.save, url, item)
                    t_restore, out = _timed(c.restore, url, skeleton)
                    del out
                    if r:
                        times[c.name]["save"].append(t_save)
                        times[c.name]["restore"].append(t_restore)
                order = order[1:] + order[:1]
            results[model] = {
                name: {k: statistics.median(v) for k, v in t.items()}
                for name, t in times.items()
            }
            _log(
                f"{server.kind} ({model}): "
                + ", ".join(
                    f"{n} save {t['save']:.2f} s / restore {t['restore']:.2f} s"
                    for n, t in results[model].items()
                )
            )
            del item
    return bucket, results


def probe(server, bucket, model):
    env = {**os.environ, **{k: v for k, v in server.env().items() if v is not None}}
    out = {}
    url = f"{bucket}/{model}/probe"
    for mode in ("save", "restore"):
        line = (
            subprocess.run(
                [sys.executable, str(HERE / "_object_probe.py"), mode, model, url],
                capture_output=True,
                text=True,
                env=env,
                timeout=900,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        got = json.loads(line)
        out[mode] = (got["peak"] - got["baseline"]) / got["model_bytes"]
        out[mode + "_total"] = got["peak"] / got["model_bytes"]
    return out


def _ratios(what, times, other):
    ours, theirs = times["orbax_eqx"], times[other]
    _log(
        f"  {what}: save {ours['save'] / theirs['save']:.2f}x, "
        f"restore {ours['restore'] / theirs['restore']:.2f}x"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="a,b")
    parser.add_argument("--stores", default="gs,s3")
    parser.add_argument("--json")
    args = parser.parse_args()
    stores = args.stores.split(",")
    for name in ("google.auth", "gcsfs"):  # no credentials: on loopback, none needed
        logging.getLogger(name).setLevel(logging.ERROR)
    models = args.only.split(",")
    logs = ROOT / ".bench-servers"
    from importlib.metadata import version

    import orbax.checkpoint as ocp

    _log(
        f"CPU, {jax.device_count()} device(s), unsharded; Python "
        f"{platform.python_version()}, jax {jax.__version__}, orbax-checkpoint "
        f"{ocp.__version__ if hasattr(ocp, '__version__') else '?'}, tensorstore "
        f"{version('tensorstore')}, boto3 {boto3.__version__}; "
        f"{os.cpu_count()} cores; loopback servers; medians of {args.repeats} rounds"
    )
    report = {}
    with _object_servers.start_gcs(logs) as gcs, _object_servers.start_s3(logs) as s3:
        if "gs" in stores:
            bucket, gs = run_store(gcs, [OrbaxEqx(), Orbax()], models, args.repeats)
            report["gs"] = {
                "times": gs,
                "memory": {m: probe(gcs, bucket, m) for m in models},
            }
        if "s3" in stores:
            contenders = [
                OrbaxEqx(),
                OrbaxEqxUnverified(),
                RawObjects(s3),
                PerArray(s3),
            ]
            bucket, s3r = run_store(s3, contenders, models, args.repeats)
            report["s3"] = {
                "times": s3r,
                "memory": {m: probe(s3, bucket, m) for m in models},
            }
    _log("\nRatios (orbax_eqx time over the other's; < 1 is faster):")
    for model in models:
        if "gs" in report:
            gs = report["gs"]["times"][model]
            _ratios(f"gs ({model}) vs plain Orbax", gs, "orbax")
        if "s3" in report:
            for other in ("raw", "per_array", "orbax_eqx_unverified"):
                _ratios(f"s3 ({model}) vs {other}", report["s3"]["times"][model], other)
        for store in report:
            m = report[store]["memory"][model]
            _log(
                f"  {store} ({model}) peak RSS growth over model bytes: save "
                f"{m['save']:.2f}x, restore {m['restore']:.2f}x (whole process: "
                f"{m['save_total']:.2f}x / {m['restore_total']:.2f}x)"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
