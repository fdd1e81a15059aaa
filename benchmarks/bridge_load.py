"""Time, memory and bytes read of loading a safetensors set into a scanned skeleton.

    python benchmarks/bridge_load.py [--layout gpt2|llama] [--layers 24]
                                     [--dim 1024] [--small] [--dir DIR]
                                     [--repeats 1]

Writes (once, into DIR) a Hugging Face set with the published names and
layouts of one of two families (`_bridge_layouts.py`), split into files of
at most 500 MB with `model.safetensors.index.json`:

- `gpt2` (the default): per-layer tensors as `GPT2LMHeadModel` names them
  (`h.{i}.attn.c_attn.weight` is PyTorch's Conv1D, (in, 3 x out): transposed
  and split into q, k, v; `c_proj`, `c_fc` transposed; layer norms and
  biases stacked), `wte` with the vocabulary padded to 50304, `wpe`; 24
  layers of width 1024 are 1.42 GB (f32), 85% of the bytes transposed.
- `llama`: as `LlamaForCausalLM` names them (`model.layers.{i}.self_attn.
  {q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, RMSNorm weights,
  `model.embed_tokens`, `model.norm`, an untied `lm_head`), with an MLP of
  ffn = 4 x dim and as many key/value heads as query heads; 24 layers of
  width 1024, vocabulary 50304: 2.02 GB (f32). `nn.Linear` holds (out, in)
  like `eqx.nn.Linear`: nothing is transposed or split, so this shows what
  the loader costs without transposes.

The skeleton is scanned: every per-layer tensor is a slice of a stacked leaf
(L, ...), in Equinox's Linear layout (out x in). DIR defaults to one per
layout and size in the temporary directory; a DIR that holds another
layout's set, or other sizes, is refused.

Loads it, each in fresh processes, with the page cache of the files evicted
before each (`posix_fadvise(DONTNEED)`), on three topologies: 1 device; 8
CPU devices in one process (stacked leaves cut across layers, P("x"), `wte`,
`wpe`, `embed`, `head` by rows); 2 processes of 4 devices (`jax.distributed`
on 127.0.0.1, the same shardings over the 8 devices). Contenders:

- `orbax_eqx`: `oeqx.load_safetensors` with the layout's mapping (GPT-2:
  renames, stack, fused qkv, Conv1D transposes; LLaMA: renames and stack),
  straight onto the target shardings;
- `glue`: what users write today: `safetensors.safe_open` per file,
  `get_tensor`, `.T` (GPT-2), `np.stack`, then `jax.make_array_from_callback`
  (`jax.device_put` for one device): every process reads the whole model;
- `raw`: the same byte ranges `orbax_eqx` reads, read with `os.preadv` into
  one buffer per range and nothing else, by 4 threads in 16 MiB pieces (as
  orbax_eqx's local reader reads; one stream would make the floor 1.3-2x
  slower than it is): the floor;
- `orbax`: Orbax's own safetensors loading (public in orbax-checkpoint
  0.12.8 as `orbax.checkpoint.experimental.v1`, `Context(checkpoint_layout=
  "safetensors")`, `load`), every tensor onto the first device, then stacked
  (and for GPT-2 split and transposed) with `jnp` and put on the target
  sharding; one process only (its per-tensor arrays cannot be stacked across
  processes without a collective).

Per process: wall time of the load (arrays ready), peak RSS growth (`VmHWM`
after resetting it through `/proc/self/clear_refs`), bytes read
(`/proc/self/io`: rchar, or read_bytes where larger; `safe_open` maps its
files, and the pages it faults in are counted by neither here, so `glue`'s
figure is a floor), and the process's share (the distinct bytes its
devices hold). Printed as ratios from one run: time / the raw read's on the
same topology, peak / share, read / share. Targets: time <= 1.2x
raw, peak RSS <= 1.3x share, bytes read <= 1.3x share.

Linux only. A benchmark, not a test: it prints. The `raw` contender imports private
modules (`orbax_eqx._bridge`, `_storage.engine`, `_tree.walk`) to plan exactly the byte
ranges orbax_eqx reads, which no public call returns.
"""

import argparse
import gc
import json
import math
import os
import socket
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)  # this checkout's orbax_eqx, not an installed one
sys.path.insert(0, os.path.dirname(HERE))
from _bridge_layouts import LAYOUTS  # noqa: E402
from _proc import status as _status  # noqa: E402

TIMEOUT_S = 1800
MIB = 2**20
CONTENDERS = ("raw", "orbax_eqx", "glue", "orbax")
TOPOLOGIES = ("1", "8", "2x4")
MAX_FILE = 500 * 10**6


# ------------------------------------------------------ the set, the skeleton


def sizes(args) -> tuple[int, int, int]:
    if args.small:
        return 8, 256, 4096
    return args.layers, args.dim, args.vocab


def write(directory: str, shapes: dict[str, tuple[int, ...]]) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    groups, size = [[]], 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 4
        if groups[-1] and size + n > MAX_FILE:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    rng = np.random.default_rng(0)
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: rng.standard_normal(shapes[n], dtype=np.float32) for n in group}
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map |= {n: file for n in group}
        del tensors
    total = sum(math.prod(s) * 4 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    from _contenders import fsync_tree

    fsync_tree(directory)


def check_set(directory: str, layout: str, shapes: dict[str, tuple[int, ...]]):
    """Refuses a set in `directory` written for another layout or size."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    total = sum(math.prod(s) * 4 for s in shapes.values())
    if (
        set(index.get("weight_map", ())) != set(shapes)
        or index.get("metadata", {}).get("total_size") != total
    ):
        sys.exit(
            f"{directory} holds a set of other tensors than the {layout} layout "
            f"at these sizes ({len(shapes)} tensors, {total} bytes): pass another "
            "--dir, or delete it to have it written again."
        )


def skeleton(lshapes):
    """A tree whose leaf names are `lshapes`' keys (nested dicts)."""
    import jax
    import numpy as np

    tree: dict = {}
    for name, shape in lshapes.items():
        *parents, last = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = jax.ShapeDtypeStruct(shape, np.float32)
    return tree


def shardings(topology: str, lshapes):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    if topology == "1":
        one = SingleDeviceSharding(jax.devices()[0])
        return {name: one for name in lshapes}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    out = {}
    for name, shape in lshapes.items():
        cut = shape[0] % 8 == 0
        out[name] = NamedSharding(mesh, P("x") if cut else P())
    return out


def share(put, lshapes) -> int:
    """Distinct bytes this process's devices hold."""
    total = 0
    for name, shape in lshapes.items():
        boxes = set()
        for index in put[name].addressable_devices_indices_map(shape).values():
            boxes.add(
                tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
            )
        total += sum(math.prod(b - a for a, b in box) * 4 for box in boxes)
    return total


# --------------------------------------------------------------- contenders


def load_ours(layout, directory, layers, dim, vocab, put):
    import orbax_eqx as oeqx

    lshapes = layout.leaf_shapes(layers, dim, vocab)
    return oeqx.load_safetensors(
        directory,
        skeleton(lshapes),
        mapping=layout.mapping(),
        shardings=lambda name, leaf: put[name],
    )


def _ranges(layout, directory, layers, dim, vocab, put):
    """The merged byte ranges, per file, that `orbax_eqx` reads here."""
    from orbax_eqx._bridge.load import leaves
    from orbax_eqx._bridge.safetensors import index as _index
    from orbax_eqx._mapping.plan import TensorSpec, leaf_specs, plan_load
    from orbax_eqx._storage import engine
    from orbax_eqx._storage.ranges import plan as merge
    from orbax_eqx._tree.walk import walk

    lshapes = layout.leaf_shapes(layers, dim, vocab)
    headers = _index.find(directory)
    tensors = {n: (h, t) for h in headers for n, t in h.tensors.items()}
    specs = leaf_specs(walk(skeleton(lshapes)))
    given = [TensorSpec(n, t.shape, t.dtype) for n, (_, t) in tensors.items()]
    plan = plan_load(layout.mapping(), specs, given, cast=False)
    spans: dict[str, dict] = {}
    targets = {spec.name: (spec, put[spec.name]) for spec in specs}
    for leaf in leaves(plan, tensors, targets, {}):
        for _, _, unit in leaf.units:
            for p in unit.pieces:
                mine = spans.setdefault(p.source.file.path, {})
                mine[len(mine)] = engine.span(p)  # the piece's bytes in its file
    return {path: merge(s, max_gap=engine.PAD)[0] for path, s in spans.items()}


def load_raw(layout, directory, layers, dim, vocab, put):
    """The same byte ranges, read in 16 MiB pieces by 4 threads (as
    orbax_eqx's local reader reads: `_bytes/local.py`), into aligned buffers:
    the floor, with the same parallelism (one stream was 1.3-2x slower here)."""
    import concurrent.futures

    from orbax_eqx._storage.ranges import aligned_empty

    ranges = _ranges(layout, directory, layers, dim, vocab, put)
    t0 = time.perf_counter()
    held, jobs, fds = [], [], []
    try:
        for path, rs in sorted(ranges.items()):
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            for a, z in rs:
                buf = aligned_empty(z - a)
                held.append(buf)
                view = memoryview(buf)
                for at in range(0, z - a, RAW_PIECE):
                    jobs.append((fd, view[at : at + RAW_PIECE], a + at))
        with concurrent.futures.ThreadPoolExecutor(RAW_READERS) as pool:
            list(pool.map(lambda job: _pread_all(*job), jobs))
    finally:
        for fd in fds:
            os.close(fd)
    return held, time.perf_counter() - t0


RAW_READERS = 4  # as `orbax_eqx/_bytes/local.py` reads
RAW_PIECE = 16 * MIB


def _pread_all(fd, view, at) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], at)
        if n == 0:
            raise EOFError(f"short read at byte {at}")
        view, at = view[n:], at + n


def load_glue(layout, directory, layers, dim, vocab, put):
    import jax
    import numpy as np
    from safetensors import safe_open

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = {}

    def get(name):
        path = os.path.join(directory, weight_map[name])
        if path not in files:
            files[path] = safe_open(path, framework="numpy").__enter__()
        return files[path].get_tensor(name)

    out = {}
    for name, tensor in layout.whole:
        out[name] = _put(get(tensor), put[name])
    for name, template, part, transposed in layout.stacked:
        layers_ = []
        for i in range(layers):
            x = get(template.format(i))
            if part is not None:
                axis, j, n = part
                step = x.shape[axis] // n
                x = np.take(x, range(j * step, (j + 1) * step), axis=axis)
            layers_.append(x.T if transposed else x)
        out[name] = _put(np.stack(layers_), put[name])
        del layers_
    jax.block_until_ready(out)
    return out


def _put(x, sharding):
    import jax

    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def load_orbax(layout, directory, layers, dim, vocab, put):
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint.experimental.v1 as ocp1

    first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=first)
        for n, s in layout.tensor_shapes(layers, dim, vocab).items()
    }
    with ocp1.Context(checkpoint_layout="safetensors"):
        flat = ocp1.load(directory, abstract)
    out = {}
    for name, tensor in layout.whole:
        out[name] = jax.device_put(flat.pop(tensor), put[name])
    for name, template, part, transposed in layout.stacked:
        layers_ = []
        for i in range(layers):
            x = flat[template.format(i)]
            if part is not None:
                axis, j, n = part
                step = x.shape[axis] // n
                x = jax.lax.slice_in_dim(x, j * step, (j + 1) * step, axis=axis)
            layers_.append(x.T if transposed else x)
        out[name] = jax.device_put(jnp.stack(layers_), put[name])
        del layers_
    del flat
    jax.block_until_ready(out)
    return out


# --------------------------------------------------------------- one probe


def _read() -> int:
    """Bytes read: by calls (`rchar`), or from storage (`read_bytes`: pages of
    a mapped file, which `safetensors.safe_open` reads), the larger."""
    found = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            found[key] = int(value)
    return max(found["rchar"], found["read_bytes"])


def probe(args) -> None:
    import warnings

    warnings.simplefilter("ignore")
    import jax

    if args.processes > 1:
        address = f"127.0.0.1:{args.port}"
        jax.distributed.initialize(
            address,
            num_processes=args.processes,
            process_id=args.process_id,
            coordinator_bind_address=address,
            initialization_timeout=120,
        )
    # Everything any contender imports, before anything is measured.
    import orbax.checkpoint.experimental.v1  # noqa: F401
    import safetensors.numpy  # noqa: F401

    import orbax_eqx  # noqa: F401

    layout = LAYOUTS[args.layout]
    layout.mapping()

    layers, dim, vocab = sizes(args)
    lshapes = layout.leaf_shapes(layers, dim, vocab)
    put = shardings(args.topology, lshapes)
    mine = share(put, lshapes)
    load = {
        "raw": load_raw,
        "orbax_eqx": load_ours,
        "glue": load_glue,
        "orbax": load_orbax,
    }[args.probe]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss, read = _status("VmRSS"), _read()
    t0 = time.perf_counter()
    out = load(layout, args.dir, layers, dim, vocab, put)
    if args.probe == "raw":
        out, seconds = out
    else:
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
    result = {
        "s": seconds,
        "peak": _status("VmHWM") - rss,
        "read": _read() - read,
        "share": mine,
        "process": jax.process_index(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    del out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_probe(args, contender: str, topology: str) -> list[dict]:
    from _contenders import evict

    evict(args.dir)
    processes = 2 if topology == "2x4" else 1
    devices = {"1": 1, "8": 8, "2x4": 4}[topology]
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO_ROOT
    port = _free_port()
    procs = []
    for i in range(processes):
        argv = [sys.executable, HERE, "--probe", contender, "--topology", topology]
        argv += ["--layout", args.layout]
        argv += [
            "--dir",
            args.dir,
            "--layers",
            str(args.layers),
            "--dim",
            str(args.dim),
        ]
        argv += ["--vocab", str(args.vocab)] + (["--small"] if args.small else [])
        argv += [
            "--processes",
            str(processes),
            "--process-id",
            str(i),
            "--port",
            str(port),
        ]
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not lines:
                raise RuntimeError(f"{contender} on {topology} failed:\n{err[-3000:]}")
            results.append(json.loads(lines[-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="gpt2")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--small", action="store_true", help="8 layers of 256: a check")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--topologies", default=",".join(TOPOLOGIES), help="a subset, as 1,8"
    )
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="a subset (raw first)"
    )
    parser.add_argument("--probe", choices=CONTENDERS)
    parser.add_argument("--topology", choices=TOPOLOGIES)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.probe:
        probe(args)
        return
    import tempfile

    layers, dim, vocab = sizes(args)
    shapes = LAYOUTS[args.layout].tensor_shapes(layers, dim, vocab)
    if args.dir is None:
        kind = "" if args.layout == "gpt2" else f"{args.layout}-"
        args.dir = os.path.join(
            tempfile.gettempdir(), f"bridge-load-{kind}{layers}x{dim}x{vocab}"
        )
    if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        print(f"writing {args.dir} ...", flush=True)
        write(args.dir, shapes)
    check_set(args.dir, args.layout, shapes)
    total = sum(math.prod(s) * 4 for s in shapes.values())
    print(
        f"{args.layout}: {layers} layers of {dim}, vocabulary {vocab}: "
        f"{total / 2**30:.2f} GiB in "
        f"{len([f for f in os.listdir(args.dir) if f.endswith('.safetensors')])} files "
        f"at {args.dir}; page cache evicted before each load; python "
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    header = (
        f"{'topology':<9}{'contender':<11}{'process':>8}{'time s':>9}{'x raw':>7}"
        f"{'peak MiB':>10}{'x share':>9}{'read MiB':>10}{'x share':>9}"
    )
    print(header)
    for topology in args.topologies.split(","):
        raw_s = None
        for contender in args.contenders.split(","):
            if contender == "orbax" and topology == "2x4":
                print(f"{topology:<9}{contender:<11}  not run: one process only")
                continue
            best = None
            for _ in range(args.repeats):
                results = run_probe(args, contender, topology)
                if best is None or max(r["s"] for r in results) < max(
                    r["s"] for r in best
                ):
                    best = results
            if contender == "raw" or raw_s is None:
                raw_s = max(r["s"] for r in best)
            for r in best:
                print(
                    f"{topology:<9}{contender:<11}{r['process']:>8}{r['s']:>9.2f}"
                    f"{r['s'] / raw_s:>7.2f}{r['peak'] / MIB:>10.0f}"
                    f"{r['peak'] / r['share']:>9.2f}{r['read'] / MIB:>10.0f}"
                    f"{r['read'] / r['share']:>9.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
