"""Where a safetensors load's time goes, stage by stage (issue 28).

    python benchmarks/bridge_stages.py [--layout gpt2] [--devices 1,8] [--repeats 3]

Loads the set `bridge_load.py` writes (run that first; the same `--dir`
default) with `oeqx.load_safetensors`, in a fresh process per device count,
with the page cache of its files evicted before each load, and times, with
timers wrapped around the loader's own functions (`orbax_eqx._bridge.fill`):

- before the fill: the index, the headers, the plan;
- the main thread: starting each batch's reads, waiting for bytes to
  arrive, waiting for the last copies of a batch, making the arrays;
- the placer threads: time spent copying pieces into place (summed over
  threads, and the wall time during which at least one was copying);
- the tail: from the last byte read to the load's end.

Prints one line per load. A benchmark, not a test: it prints. Linux only.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(HERE))


class _Clock:
    """Intervals per stage: (thread, start, stop)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[int, float, float]]] = {}
        self._lock = threading.Lock()

    def timed(self, stage: str, fn):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.spans.setdefault(stage, []).append(
                        (threading.get_ident(), t, time.perf_counter())
                    )

        return wrapped

    def total(self, stage: str) -> float:
        return sum(b - a for _, a, b in self.spans.get(stage, ()))

    def covered(self, stage: str) -> float:
        """Wall time during which at least one span of `stage` ran."""
        out, end = 0.0, -1.0
        for _, a, b in sorted(self.spans.get(stage, ()), key=lambda s: s[1]):
            if b <= end:
                continue
            out += b - max(a, end)
            end = b
        return out

    def last(self, stage: str) -> float:
        return max((b for _, _, b in self.spans.get(stage, ())), default=0.0)


class _TimedReads:
    def __init__(self, reads, clock: _Clock):
        self._reads = reads
        self.ready = clock.timed("wait for bytes", reads.ready)
        self.wait = clock.timed("wait for bytes", reads.wait)

    def __getattr__(self, name):
        return getattr(self._reads, name)


def probe(args) -> None:
    import bridge_load as bl
    import jax
    from _contenders import evict

    from orbax_eqx._bridge import fill

    if args.placers:
        fill.PLACERS = args.placers
    if args.copy_window:
        fill.COPY_WINDOW = args.copy_window << 20
    clock = _Clock()
    fill._place = clock.timed("copy", fill._place)
    fill._finish = clock.timed("make arrays", fill._finish)
    fill.fill = clock.timed("fill", fill.fill)
    fill._Batch.__init__ = clock.timed("start reads", fill._Batch.__init__)
    fill._Batch.finish = clock.timed("finish batch", fill._Batch.finish)
    opened = fill._open

    def timed_open(*a, **k):
        reader, reads = opened(*a, **k)
        return reader, _TimedReads(reads, clock)

    fill._open = timed_open
    # load_safetensors imports fill's names at call time through the module.
    layout = bl.LAYOUTS[args.layout]
    layers, dim, vocab = bl.sizes(args)
    lshapes = layout.leaf_shapes(layers, dim, vocab)
    put = bl.shardings(args.topology, lshapes)
    evict(args.dir)
    t0 = time.perf_counter()
    out = bl.load_ours(layout, args.dir, layers, dim, vocab, put)
    jax.block_until_ready(out)
    t1 = time.perf_counter()
    fill_spans = clock.spans.get("fill", [(0, t0, t1)])
    fill_start = min(a for _, a, _ in fill_spans)
    finish = clock.total("finish batch")
    waits = clock.total("wait for bytes")
    result = {
        "total": t1 - t0,
        "before fill": fill_start - t0,
        "start reads": clock.total("start reads"),
        "wait for bytes": waits,
        "wait for copies": finish - waits,
        "make arrays": clock.total("make arrays"),
        "copy (threads)": clock.total("copy"),
        "copy (wall)": clock.covered("copy"),
        "after last byte": t1 - clock.last("wait for bytes"),
        "copies": len(clock.spans.get("copy", ())),
    }
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="gpt2")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--devices", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--placers", type=int, default=0, help="0: the loader's")
    parser.add_argument(
        "--copy-window", type=int, default=0, help="MiB; 0: the loader's"
    )
    parser.add_argument("--topology", default=None)
    args = parser.parse_args()
    if args.dir is None:
        import tempfile

        import bridge_load as bl

        layers, dim, vocab = bl.sizes(args)
        kind = "" if args.layout == "gpt2" else f"{args.layout}-"
        args.dir = os.path.join(
            tempfile.gettempdir(), f"bridge-load-{kind}{layers}x{dim}x{vocab}"
        )
    if args.topology:
        probe(args)
        return
    if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        sys.exit(f"no set at {args.dir}: run benchmarks/bridge_load.py first")
    print(
        f"{args.layout} at {args.dir}; python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; placers "
        f"{args.placers or 'default'}, copy window "
        f"{args.copy_window or 'default'} MiB; seconds",
        flush=True,
    )
    for devices in args.devices.split(","):
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env["JAX_PLATFORMS"] = "cpu"
        env["PYTHONPATH"] = REPO_ROOT
        for _ in range(args.repeats):
            argv = [sys.executable, HERE, "--topology", devices, "--dir", args.dir]
            argv += ["--layout", args.layout, "--layers", str(args.layers)]
            argv += ["--dim", str(args.dim), "--vocab", str(args.vocab)]
            argv += ["--small"] if args.small else []
            argv += ["--placers", str(args.placers)]
            argv += ["--copy-window", str(args.copy_window)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not lines:
                sys.exit(f"{devices} devices failed:\n{done.stderr[-3000:]}")
            r = json.loads(lines[-1][7:])
            parts = "  ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in r.items()
            )
            print(f"{devices} devices: {parts}", flush=True)


if __name__ == "__main__":
    main()
