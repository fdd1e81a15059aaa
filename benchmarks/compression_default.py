"""Should compression be on by default, and on which storage? Measured.

    python benchmarks/compression_default.py [--repeats N] [--stores disk,gs]
                                             [--json FILE]

Two items built from model (a) (`_models.py`, 0.5 GiB of float32):

- `weights`: its arrays drawn at random (normal), like trained weights: zstd
  finds little to take out of float mantissas;
- `adam`: a fresh Adam state of the same model (optax's `mu` and `nu`, all
  zeros, and the step count), what a step-0 checkpoint of a training run
  holds beside the weights: constants, which zstd takes out almost entirely.

Each is saved and restored by four contenders, taking turns (A B C D, then
B C D A, ...), on a local disk (page cache evicted before each restore) and
on gs:// (fake-gcs-server on loopback, started here):

- `packed`: orbax_eqx's default (pack files, no compression: packs are
  never compressed);
- `per_leaf`: `pack=False`, one Orbax array per leaf, uncompressed;
- `per_leaf_zstd`: `pack=False, use_compression=True`, Orbax's zstd chunks;
- `orbax`: plain Orbax's `StandardCheckpointer` (zstd, its default).

s3:// is not measured: orbax_eqx stores only packs there (`pack=False` is
refused on s3://, and plain Orbax cannot write it), so compression cannot
apply. Prints medians of the rounds, the stored bytes, and the ratios
against `packed` from this run.
"""

import argparse
import gc
import json
import logging
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import _contenders  # noqa: E402
import _models  # noqa: E402
import equinox as eqx  # noqa: E402
import fsspec  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402
from integration_tests import _object_servers  # noqa: E402


class Options:
    def __init__(self, name, **options):
        self.name, self.options = name, options

    def save(self, path, item):
        oeqx.save(path, item, **self.options)

    def restore(self, path, skeleton):
        return oeqx.restore(path, skeleton)


CONTENDERS = [
    Options("packed"),
    Options("per_leaf", pack=False),
    Options("per_leaf_zstd", pack=False, use_compression=True),
    _contenders.Orbax(),
]


def items():
    """`{name: (item, skeleton)}`: the weights, and a fresh Adam state of them."""
    weights, skeleton = _models.build("a"), _models.skeleton("a")
    adam = optax.adam(1e-3).init(eqx.filter(weights, eqx.is_array))
    adam = jax.block_until_ready(adam)
    structs = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), adam
    )
    return {"weights": (weights, skeleton), "adam": (adam, structs)}


def stored_bytes(url: str) -> int:
    if "://" not in url:
        return _contenders.disk_bytes(url)
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return fs.du(path)


def remove(url: str) -> None:
    if "://" not in url:
        shutil.rmtree(url)
        return
    fs, path = fsspec.core.url_to_fs(url)
    fs.rm(path, recursive=True)
    fs.invalidate_cache()


def _timed(fn, *args):
    gc.collect()
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def run(where: str, root: str, repeats: int, evict: bool) -> dict:
    results = {}
    for label, (item, skeleton) in items().items():
        times = {c.name: {"save": [], "restore": []} for c in CONTENDERS}
        sizes = {}
        order = list(CONTENDERS)
        for r in range(repeats + 1):  # round 0 warms up, not counted
            for c in order:
                url = f"{root}/{label}/{c.name}/{r}"
                t_save, _ = _timed(c.save, url, item)
                if evict:
                    _contenders.evict(url)
                t_restore, out = _timed(c.restore, url, skeleton)
                del out
                if r:
                    times[c.name]["save"].append(t_save)
                    times[c.name]["restore"].append(t_restore)
                sizes[c.name] = stored_bytes(url)
                remove(url)  # fake-gcs-server keeps every object in memory
            order = order[1:] + order[:1]
        results[label] = {
            name: {
                "save": statistics.median(t["save"]),
                "restore": statistics.median(t["restore"]),
                "bytes": sizes[name],
            }
            for name, t in times.items()
        }
        _report(where, label, results[label])
    return results


def _report(where: str, label: str, got: dict) -> None:
    base = got["packed"]
    print(f"\n{where}, {label}:", flush=True)
    print("  contender        save s  restore s  stored MiB | over packed's: ", end="")
    print("save  restore  bytes")
    for name, g in got.items():
        ratios = [g[k] / base[k] for k in ("save", "restore", "bytes")]
        print(
            f"  {name:15s} {g['save']:7.2f}  {g['restore']:9.2f}  "
            f"{g['bytes'] / 2**20:10.1f} |         "
            + "  ".join(f"{r:5.2f}x" for r in ratios),
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stores", default="disk,gs")
    parser.add_argument("--dir", default=None, help="where to write on disk")
    parser.add_argument("--json")
    args = parser.parse_args()
    for name in ("google.auth", "gcsfs"):  # no credentials: on loopback, none needed
        logging.getLogger(name).setLevel(logging.ERROR)
    print(
        f"CPU, {jax.device_count()} device(s), unsharded; Python "
        f"{platform.python_version()}, jax {jax.__version__}, orbax-checkpoint "
        f"{ocp.__version__}; {os.cpu_count()} cores; medians of {args.repeats} "
        "rounds after a warm-up round",
        flush=True,
    )
    report = {}
    stores = args.stores.split(",")
    if "disk" in stores:
        with tempfile.TemporaryDirectory(prefix="oeqx-zstd-", dir=args.dir) as d:
            report["disk"] = run("disk", d, args.repeats, evict=True)
    if "gs" in stores:
        logs = ROOT / ".bench-servers"
        with _object_servers.start_gcs(logs) as gcs:
            bucket = gcs.create_bucket(f"zstd-{uuid.uuid4().hex[:12]}")
            with _object_servers.environ(gcs.env()):
                _object_servers.clear_fsspec_caches()
                report["gs"] = run("gs://", bucket, args.repeats, evict=False)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
