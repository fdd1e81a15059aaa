"""Steps that store each unchanged leaf once: `EqxHandler(dedup=True)` against
`EqxHandler()` and plain Orbax, step after step through one manager.

    python benchmarks/dedup.py [--model i|ii|both] [--gib 1] [--saves 20]
                               [--devices 1|8] [--store local|s3] [--profile]

Two models of `--gib` GiB of float32 base matrices, saved `--saves` times
each through one `ocp.CheckpointManager(max_to_keep=3)` per contender; the
contenders save the same arrays at each step, in a rotated order:

- (i) a frozen base beside a trainable adapter of ~1% of its size, with its
  `optax.adam` state: `eqx.partition` into trainable and frozen, a real Adam
  step on the trainable part before each save, `eqx.combine` back, so the
  base is the very same arrays at every save;
- (ii) the same tree with every leaf changed at every step (the Adam step,
  and the base decayed by 1e-4).

Contenders: `EqxHandler(dedup=True)`, `EqxHandler()`, plain Orbax
(`ocp.StandardCheckpointHandler`, `args.StandardSave` of
`eqx.filter(item, eqx.is_array)`; not on s3://, where its array store cannot
write). Figures, medians over the saves after the first: bytes written per
save (the sizes of the files under the root that are new or changed after
it, sidecars and Orbax's metadata included), save time (`save` and
`wait_until_finished`), how long `save` blocks; after the last save, the
bytes under the root and the restore time of each kept step (median; the page
cache dropped before each where the script can, every restore compared with
what was saved, bit for bit). Ratios are to dedup off, checked against the
targets of the store-once plan.

`--devices 8`: 8 CPU devices in a fresh process, the base sharded `P("fsdp")`,
the rest replicated. `--store s3`: a loopback moto_server that the script
starts (`integration_tests/_object_servers.py`). `--profile`: samples every
thread's stack during the saves of both `EqxHandler`s and prints where
they spend it.
"""

import argparse
import collections
import datetime
import json
import logging
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import xxhash  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_eqx as oeqx  # noqa: E402

MiB = 2**20
GiB = 2**30
COLS = 4096  # of each base matrix, float32
KEEP = 3


def _log(text=""):
    print(text, flush=True)


# --- the models ---------------------------------------------------------------


class Model(eqx.Module):
    """A frozen base of matrices and a trainable low-rank adapter on its output."""

    base: list
    down: eqx.nn.Linear
    up: eqx.nn.Linear

    def __call__(self, x):
        h = x @ self.base[0]
        return jax.vmap(self.up)(jax.nn.gelu(jax.vmap(self.down)(h)))


def _models(gib: float, devices: int):
    """`(first, advance, parts, shape)`: the first item of a model, the next
    step's (a real Adam step; with `every_leaf`, the base changed too), the
    bytes of the base and of the rest, and a line saying what it holds."""
    total = int(gib * GiB)
    matrix = min(32 * MiB, total // 8)  # a few dozen at 1 GiB, 8 at least
    rows = max(8, matrix // (COLS * 4) // 8 * 8)
    count = max(1, round(total / (rows * COLS * 4)))
    rank = max(1, round(0.01 * count * rows * COLS / (2 * COLS + 1)))
    mesh = jax.make_mesh((devices,), ("fsdp",))
    sharded = NamedSharding(mesh, P("fsdp"))
    replicated = NamedSharding(mesh, P())
    opt = optax.adam(1e-3)
    x = jax.device_put(jnp.ones((8, rows), jnp.float32) / rows, replicated)

    def spec_of(model):
        """True for the adapter (trained), False for the base (frozen)."""
        spec = jax.tree_util.tree_map(lambda _: False, model)
        return eqx.tree_at(
            lambda m: (m.down, m.up),
            spec,
            replace=(
                jax.tree_util.tree_map(lambda _: True, model.down),
                jax.tree_util.tree_map(lambda _: True, model.up),
            ),
        )

    @eqx.filter_jit
    def train(trainable, frozen, opt_state):
        def loss(t):
            return jnp.mean(jnp.square(eqx.combine(t, frozen)(x) - 1))

        grads = jax.grad(loss)(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    decay = jax.jit(lambda w: w * (1 - 1e-4), donate_argnums=0)

    def first():
        rng = np.random.default_rng(0)
        base = [
            jax.device_put(rng.standard_normal((rows, COLS), np.float32), sharded)
            for _ in range(count)
        ]
        k1, k2 = jax.random.split(jax.random.key(0))

        def put(layer):
            return jax.tree_util.tree_map(
                lambda a: jax.device_put(a, replicated), layer
            )

        model = Model(
            base,
            put(eqx.nn.Linear(COLS, rank, key=k1)),
            put(eqx.nn.Linear(rank, COLS, key=k2)),
        )
        trainable, _ = eqx.partition(model, spec_of(model))
        item = {"model": model, "opt_state": opt.init(trainable), "step": 0}
        return jax.block_until_ready(item)

    def advance(item, every_leaf: bool):
        model = item["model"]
        if every_leaf:  # (ii): new base arrays too (the old ones donated)
            model = eqx.tree_at(lambda m: m.base, model, [decay(w) for w in model.base])
        trainable, frozen = eqx.partition(model, spec_of(model))
        trainable, opt_state = train(trainable, frozen, item["opt_state"])
        out = {
            "model": eqx.combine(trainable, frozen),
            "opt_state": opt_state,
            "step": item["step"] + 1,
        }
        return jax.block_until_ready(out)

    def parts(item):
        """Bytes of the base, and of what changes in (i): adapter and Adam state."""
        base = sum(w.nbytes for w in item["model"].base)
        leaves = jax.tree_util.tree_leaves(item)
        arrays = sum(x.nbytes for x in leaves if eqx.is_array(x))
        return base, arrays - base

    shape = f"{count} x ({rows}, {COLS}) float32 base, adapter rank {rank}"
    return first, advance, parts, shape


# --- the contenders -------------------------------------------------------------


def _contenders(store: str):
    def options():
        extra = {}
        if store == "s3":
            extra["temporary_path_class"] = ocp.path.atomicity.CommitFileTemporaryPath
        return ocp.CheckpointManagerOptions(max_to_keep=KEEP, **extra)

    def ours(name, **handler):
        def manager(root):
            return ocp.CheckpointManager(
                root, item_handlers=oeqx.EqxHandler(**handler), options=options()
            )

        def restore(mngr, step, skeleton):
            return mngr.restore(step, args=oeqx.EqxRestore(skeleton))

        return name, manager, oeqx.EqxSave, restore

    def orbax_manager(root):
        return ocp.CheckpointManager(
            root, item_handlers=ocp.StandardCheckpointHandler(), options=options()
        )

    def orbax_args(item):
        return ocp.args.StandardSave(eqx.filter(item, eqx.is_array))

    def orbax_restore(mngr, step, skeleton):
        abstract, static = eqx.partition(
            skeleton, lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )
        got = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
        return eqx.combine(got, static)

    out = [ours("dedup", dedup=True), ours("dedup off")]
    if store != "s3":
        out.append(("plain Orbax", orbax_manager, orbax_args, orbax_restore))
    return out


# --- what is stored -------------------------------------------------------------


class LocalFiles:
    def __init__(self, base: str):
        self.base = base

    def root(self, name: str) -> str:
        return os.path.join(self.base, name.replace(" ", "-"))

    def listing(self, root: str) -> dict:
        """`{path: (size, identity)}`: identity changes when a file is rewritten."""
        out = {}
        for where, _, files in os.walk(root):
            for f in files:
                path = os.path.join(where, f)
                st = os.lstat(path)
                out[path] = (st.st_size, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
        return out

    def sidecar(self, root: str, step: int) -> bytes:
        return pathlib.Path(root, str(step), "default", "orbax_eqx.json").read_bytes()

    def drop_cache(self, root: str) -> str:
        """Drops the page cache (root), else this root's files from it."""
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "cold cache (drop_caches before each restore)"
        except OSError:
            pass
        if not hasattr(os, "posix_fadvise"):
            return "warm cache"
        for where, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(where, f), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "cold cache (the root's files evicted by posix_fadvise)"


class S3Objects:
    def __init__(self, server, bucket: str):
        import boto3

        self.bucket = bucket.removeprefix("s3://")
        self.s3 = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")

    def root(self, name: str) -> str:
        return f"s3://{self.bucket}/{name.replace(' ', '-')}"

    def listing(self, root: str) -> dict:
        prefix = root.removeprefix(f"s3://{self.bucket}/") + "/"
        out = {}
        pages = self.s3.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = (o["Size"], (o["ETag"], o["LastModified"]))
        return out

    def sidecar(self, root: str, step: int) -> bytes:
        key = (
            root.removeprefix(f"s3://{self.bucket}/")
            + f"/{step}/default/orbax_eqx.json"
        )
        return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def drop_cache(self, root: str) -> str:
        return "objects in moto_server's memory (no page cache)"


# --- a run -----------------------------------------------------------------------


class Sampler:
    """Where every thread is, every 5 ms: the innermost frame of orbax_eqx,
    xxhash, numpy, orbax or tensorstore code, by function, while `on` names
    the contender saving."""

    PACKAGES = (
        "orbax_eqx",
        "orbax/checkpoint",
        "numpy",
        "xxhash",
        "tensorstore",
        "msgspec",
    )

    def __init__(self):
        self.on = ""
        self.counts = collections.defaultdict(collections.Counter)
        self.samples = collections.Counter()
        self._done = threading.Event()
        self._me = None
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        self._me = threading.get_ident()
        while not self._done.wait(0.005):
            on = self.on
            if not on:
                continue
            self.samples[on] += 1
            for ident, frame in sys._current_frames().items():
                if ident == self._me:
                    continue
                where, inner = [], frame
                while frame is not None:
                    code = frame.f_code
                    if any(k in code.co_filename for k in self.PACKAGES):
                        where.append(frame)
                    frame = frame.f_back
                if not where:
                    continue
                code = inner.f_code
                if code.co_name in (
                    "wait",
                    "_wait_for_tstate_lock",
                    "select",
                    "acquire",
                ):
                    continue  # a thread waiting, not working
                top = where[0].f_code
                name = top.co_filename.split("site-packages/")[-1].split("wt-dbench/")[
                    -1
                ]
                self.counts[on][f"{name}:{top.co_name}"] += 1

    def close(self):
        self._done.set()
        self._thread.join()

    def report(self, saves: int, top: int = 12):
        for on, counts in self.counts.items():
            _log(
                f"  Profile of {on}'s saves after the first: "
                f"{self.samples[on] * 0.005 / saves:.3f} s a save, busy threads "
                "(s a save, by the innermost frame of these packages):"
            )
            for where, n in counts.most_common(top):
                _log(f"    {n * 0.005 / saves:7.3f}  {where}")


def _digest(tree) -> list[str]:
    """The XXH3-128 of each array leaf of `tree`: what a restore must give back."""
    return [
        xxhash.xxh3_128_hexdigest(np.ascontiguousarray(np.asarray(x)).view(np.uint8))
        for x in jax.tree_util.tree_leaves(tree)
        if eqx.is_array(x)
    ]


def _restore_kept(store, roots, managers, restorer, skeleton, digests, repeats):
    """Seconds of each contender's restores of each kept step (`repeats` times
    over), in a rotated order, each compared with what was saved; and the
    cache they ran with."""
    restored = {name: [] for name in roots}
    order, cache = list(roots), ""
    for step in sorted(digests) * repeats:
        for name in order:
            cache = store.drop_cache(roots[name])
            start = time.perf_counter()
            got = jax.block_until_ready(restorer[name](managers[name], step, skeleton))
            restored[name].append(time.perf_counter() - start)
            if _digest(got) != digests[step]:
                raise SystemExit(f"{name}: step {step} restored other bytes")
            del got
        order = order[1:] + order[:1]
    return restored, cache


def run_model(model: str, args, store) -> dict:
    first, advance, parts, shape = _models(args.gib, args.devices)
    contenders = _contenders(args.store)
    roots = {name: store.root(f"{model}-{name}") for name, *_ in contenders}
    managers = {name: make(roots[name]) for name, make, *_ in contenders}
    written = {name: [] for name in roots}
    saved = {name: [] for name in roots}
    blocked = {name: [] for name in roots}
    digests = {}  # step: XXH3-128 of each array leaf, for the kept steps
    sampler = Sampler() if args.profile else None

    item = first()
    base_bytes, changed_bytes = parts(item)
    skeleton = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if eqx.is_array(x)
            else x
        ),
        item,
    )
    _log(
        f"Model ({model}): {shape}; base {base_bytes / MiB:.1f} MiB, adapter and "
        f"Adam state {changed_bytes / MiB:.2f} MiB "
        f"({changed_bytes / base_bytes * 100:.2f}% of the base); "
        + ("every leaf changes at each step" if model == "ii" else "the base frozen")
    )
    order = [name for name, *_ in contenders]
    argmaker = {name: a for name, _, a, _ in contenders}
    for step in range(args.saves):
        if step:
            item = advance(item, every_leaf=model == "ii")
        if step >= args.saves - KEEP:
            digests[step] = _digest(item)
        for name in order:
            mngr = managers[name]
            before = store.listing(roots[name])
            if sampler is not None and name != "plain Orbax" and step:
                sampler.on = name
            start = time.perf_counter()
            mngr.save(step, args=argmaker[name](item))
            returned = time.perf_counter()
            mngr.wait_until_finished()
            done = time.perf_counter()
            if sampler is not None:
                sampler.on = ""
            after = store.listing(roots[name])
            new = sum(
                size
                for p, (size, ident) in after.items()
                if before.get(p) != (size, ident)
            )
            written[name].append(new)
            saved[name].append(done - start)
            blocked[name].append(returned - start)
        order = order[1:] + order[:1]
        _log(
            f"  step {step:2d}: "
            + "; ".join(
                f"{n} {written[n][-1] / MiB:8.2f} MiB {saved[n][-1]:6.3f} s "
                f"(blocks {blocked[n][-1]:.3f})"
                for n in roots
            )
        )
    del item
    if sampler is not None:
        sampler.close()
        sampler.report(args.saves - 1)
    stored = {
        name: sum(s for s, _ in store.listing(roots[name]).values()) for name in roots
    }
    packs = collections.Counter()  # {shared pack: bytes}, its parts on s3:// summed
    for path, (size, _) in store.listing(roots["dedup"]).items():
        if "orbax_eqx~shared/" in path:
            packs[path.rsplit("/", 1)[-1].split(".part-")[0]] += size
    sidecar = len(store.sidecar(roots["dedup"], args.saves - 1))
    kept = {name: managers[name].all_steps() for name in roots}
    for name in roots:
        if kept[name] != sorted(digests):
            raise SystemExit(f"{name} kept steps {kept[name]}")
    restorer = {name: r for name, _, _, r in contenders}
    restored, cache = _restore_kept(
        store, roots, managers, restorer, skeleton, digests, args.restores
    )
    live = set()  # the shared packs the kept steps refer to
    for step in kept["dedup"]:
        content = json.loads(store.sidecar(roots["dedup"], step))
        live |= {p["file"] for p in content["packs"] if p.get("shared")}
    for mngr in managers.values():
        mngr.close()
    # Once the managers are closed (dedup's handler collects what the steps
    # its retention deleted after the last save alone held).
    closed = {
        name: sum(s for s, _ in store.listing(roots[name]).values()) for name in roots
    }
    return {
        "closed": closed,
        "model": model,
        "shape": shape,
        "base": base_bytes,
        "changed": changed_bytes,
        "sidecar": sidecar,
        "written": written,
        "saved": saved,
        "blocked": blocked,
        "stored": stored,
        "restored": restored,
        "cache": cache,
        "sharded": args.devices > 1,
        "packs": packs,
        # (shard packs are listed by shard indexes, not sidecars: not counted)
        "unreferenced": sum(
            n for f, n in packs.items() if f not in live and "~shards." not in f
        ),
    }


# --- the table ---------------------------------------------------------------------


def _med(xs):
    return statistics.median(xs[1:]) if len(xs) > 1 else xs[0]


def _verdict(label, value, target):
    ok = "PASS" if value <= target else "MISS"
    _log(f"  [{ok}] {label}: {value:.3f} (target <= {target})")


def table(r: dict) -> None:
    names = list(r["written"])
    off = "dedup off"
    _log(
        f"\nModel ({r['model']}), {r['shape']}: medians of saves 2 to "
        f"{len(r['written'][off])}; {len(r['restored'][off])} restores of the "
        f"{KEEP} kept steps ({r['cache']})"
    )
    _log(
        "| contender | first save MiB | MiB written / save | save s | save() blocks s "
        "| MiB stored | restore s "
        "| written, save, blocks, stored, restore / dedup off |"
    )
    _log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in names:
        w, s, b = _med(r["written"][n]), _med(r["saved"][n]), _med(r["blocked"][n])
        st, rs = r["stored"][n], statistics.median(r["restored"][n])
        ratios = (
            ""
            if n == off
            else (
                f"{w / _med(r['written'][off]):.3f}x, "
                f"{s / _med(r['saved'][off]):.3f}x, "
                f"{b / _med(r['blocked'][off]):.3f}x, "
                f"{st / r['stored'][off]:.3f}x, "
                f"{rs / statistics.median(r['restored'][off]):.3f}x"
            )
        )
        _log(
            f"| {n} | {r['written'][n][0] / MiB:.1f} | {w / MiB:.2f} | {s:.3f} "
            f"| {b:.3f} | {st / MiB:.1f} | {rs:.3f} | {ratios} |"
        )
    _log(
        "  each save: "
        + "; ".join(
            f"{n}: " + ", ".join(f"{t:.2f}" for t in r["saved"][n]) for n in names
        )
    )
    _log(
        "  restores (s, kept steps in order): "
        + "; ".join(
            f"{n}: " + ", ".join(f"{t:.3f}" for t in r["restored"][n]) for n in names
        )
    )
    packs = sorted(r["packs"].values(), reverse=True)
    _log(
        f"  dedup's shared directory after the last save: {len(packs)} packs, "
        f"{sum(packs) / MiB:.1f} MiB ("
        + ", ".join(f"{p / MiB:.2f}" for p in packs)
        + f" MiB), of which {r['unreferenced'] / MiB:.2f} MiB in packs no kept "
        "step's sidecar lists (the next save deletes them; shard packs not counted)"
    )
    _log(
        "  MiB stored once the managers are closed: "
        + "; ".join(f"{n} {r['closed'][n] / MiB:.1f}" for n in names)
        + f" ({r['closed']['dedup'] / r['closed'][off]:.3f}x dedup off)"
    )
    if r["sharded"]:
        once = _med(r["written"]["dedup"]) < r["base"] / 2
        _log(
            "  sharded base: "
            + (
                "stored once"
                if once
                else "written again at each save (sharded dedup is not in the "
                "installed package: the figures show it)"
            )
        )
    d = "dedup"
    save = _med(r["saved"][d]) / _med(r["saved"][off])
    paired = statistics.median(
        a / b for a, b in zip(r["saved"][d][1:], r["saved"][off][1:], strict=True)
    )
    _log(
        f"  save time, median of the ratios of each step's dedup save to its dedup "
        f"off save (run back to back): {paired:.3f}x"
    )
    restore = statistics.median(r["restored"][d]) / statistics.median(
        r["restored"][off]
    )
    if r["model"] == "i":
        floor = r["changed"] + r["sidecar"]
        _log(
            f"  changed leaves {r['changed'] / MiB:.2f} MiB + sidecar "
            f"{r['sidecar'] / 1024:.1f} KiB = {floor / MiB:.2f} MiB a save; "
            f"base + {KEEP} x changed = "
            f"{(r['base'] + KEEP * r['changed']) / MiB:.1f} MiB"
        )
        _verdict(
            "dedup MiB written / save over changed + sidecar",
            _med(r["written"][d]) / floor,
            1.1,
        )
        _verdict("dedup save time / dedup off", save, 0.1)
        _verdict(
            f"dedup bytes stored / (base + {KEEP} x changed)",
            r["stored"][d] / (r["base"] + KEEP * r["changed"]),
            1.05,
        )
        _verdict(
            f"the same, the manager closed / (base + {KEEP} x changed)",
            r["closed"][d] / (r["base"] + KEEP * r["changed"]),
            1.05,
        )
    else:
        _verdict("dedup save time / dedup off", save, 1.03)
    _verdict("dedup restore / a self-contained step's (dedup off)", restore, 1.05)


def _versions(store: str) -> str:
    from importlib.metadata import version

    names = [
        "jax",
        "jaxlib",
        "orbax-checkpoint",
        "orbax_eqx",
        "equinox",
        "optax",
        "numpy",
        "tensorstore",
    ]
    if store == "s3":
        names += ["boto3", "moto"]
    got = []
    for n in names:
        try:
            got.append(f"{n} {version(n)}")
        except Exception:
            got.append(f"{n} ?")
    return f"Python {platform.python_version()}, " + ", ".join(got)


class _Quiet(logging.Filter):
    """Drops Orbax's "Waiting for previous save to complete took N seconds":
    each save here starts after `wait_until_finished`, and `save()` returns
    within milliseconds (the table's "blocks"); N is the previous save's time."""

    def filter(self, record):
        return "Waiting for previous save" not in record.getMessage()


def _commit() -> str:
    """The git commit of the orbax_eqx imported, if it is a checkout."""
    where = pathlib.Path(oeqx.__file__).parent
    try:
        return subprocess.run(
            ["git", "-C", str(where), "log", "-1", "--format=%h %cI"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except Exception:
        return str(where)


def run(args) -> None:
    logging.getLogger("absl").addFilter(_Quiet())
    models = ["i", "ii"] if args.model == "both" else [args.model]
    load = os.getloadavg()
    _log(
        f"Store once (dedup): "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"backend {jax.default_backend()}, {jax.device_count()} device(s)"
        f"{', base sharded P(fsdp)' if args.devices > 1 else ''}; store {args.store}; "
        f"{args.gib} GiB base, {args.saves} saves, max_to_keep={KEEP}; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    _log(f"  {_versions(args.store)}; orbax_eqx from {_commit()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        if args.store == "s3":
            from integration_tests import _object_servers

            server = _object_servers.start_s3(pathlib.Path(base) / "logs")
            try:
                bucket = server.create_bucket("dedup-bench")
                with _object_servers.environ(server.env()):
                    _object_servers.clear_fsspec_caches()
                    store = S3Objects(server, bucket)
                    for m in models:
                        table(run_model(m, args, store))  # each as soon as it is done
            finally:
                try:
                    server.stop()
                except subprocess.TimeoutExpired:  # it dies with this process
                    _log("(moto_server was slow to exit)")
        else:
            store = LocalFiles(base)
            for m in models:
                table(run_model(m, args, store))
    load = os.getloadavg()
    _log(f"\nLoad average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["i", "ii", "both"], default="both")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--devices", type=int, choices=[1, 8], default=1)
    parser.add_argument("--store", choices=["local", "s3"], default="local")
    parser.add_argument("--restores", type=int, default=3, help="times each kept step")
    parser.add_argument("--dir", help="where the local roots go (default: $TMPDIR)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.saves <= KEEP:
        parser.error(f"--saves must be more than max_to_keep ({KEEP})")
    if args.devices > 1 and not args.child:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
        raise SystemExit(
            subprocess.call(
                [sys.executable, __file__, *sys.argv[1:], "--child"], env=env
            )
        )
    run(args)


if __name__ == "__main__":
    main()
