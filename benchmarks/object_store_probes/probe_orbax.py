"""Probe: Orbax's Checkpointer / CheckpointManager commit on s3:// and gs://,
and what epath (s3fs / gcsfs) does with empty "directories".

Each case runs in a fresh process (fsspec caches filesystems) with a time
limit; a failure prints the exception and the innermost frames, to show where.
Public Orbax APIs only. Run: PYTHONPATH=. python probes/probe_orbax.py [labels]
"""

import os
import subprocess
import sys
import textwrap
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))
import _servers  # noqa: E402

LIMIT = 120
ONLY = sys.argv[1:]

PRELUDE = """
import os, sys, time, traceback, logging
logging.disable(logging.WARNING)
import orbax.checkpoint as ocp
from etils import epath
CommitFileTemporaryPath = ocp.path.atomicity.CommitFileTemporaryPath
ROOT = epath.Path(os.environ["PROBE_ROOT"])

def objects():
    import fsspec
    fs = fsspec.filesystem("s3" if str(ROOT).startswith("s3") else "gcs")
    fs.invalidate_cache()
    b = str(ROOT).split("://")[1]
    return sorted(p.split("/", 1)[1] for p in fs.find(b))

def fail(e):
    tb = traceback.extract_tb(e.__traceback__)
    def fmt(f):
        return f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
    print("  FAILED", type(e).__name__, str(e)[:300].replace(chr(10), " "))
    print("  innermost:", " <- ".join(fmt(f) for f in reversed(tb[-3:])))
    ours = [f for f in tb if "orbax/" in f.filename]
    print("  innermost Orbax:", " <- ".join(fmt(f) for f in reversed(ours[-4:])))
    print("  objects left:", objects())
"""

CHECKPOINTER = """
kwargs = {TEMP}
ckptr = ocp.Checkpointer(ocp.JsonCheckpointHandler(), **kwargs)
try:
    ckptr.save(ROOT / "ckpt", args=ocp.args.JsonSave({"a": 1, "b": [1, 2]}))
    print("  saved; objects:", objects())
    print("  restored:", ckptr.restore(ROOT / "ckpt", args=ocp.args.JsonRestore()))
except Exception as e:
    fail(e)
"""

MANAGER = """
opts = dict(max_to_keep=2, enable_async_checkpointing={ASYNC}, create={CREATE})
if {TEMP}:
    opts["temporary_path_class"] = CommitFileTemporaryPath
def manager():
    return ocp.CheckpointManager(ROOT / "run",
        item_handlers=ocp.JsonCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(**opts))
try:
    t = time.monotonic()
    mngr = manager()
    print("  fresh: all_steps", mngr.all_steps(), "latest", mngr.latest_step())
    for step in range(4):
        mngr.save(step, args=ocp.args.JsonSave({{"step": step}}))
    mngr.wait_until_finished()
    print(f"  4 saves in {{time.monotonic() - t:.1f}} s")
    print("  all_steps", mngr.all_steps(), "latest", mngr.latest_step())
    print("  restore(latest):", mngr.restore(mngr.latest_step(),
          args=ocp.args.JsonRestore()))
    print("  objects:", objects())
    mngr.close()
    # An uncommitted step: objects under run/7/ but no commit marker.
    (ROOT / "run" / "7").mkdir(parents=True, exist_ok=True)
    (ROOT / "run" / "7" / "default").mkdir(parents=True, exist_ok=True)
    (ROOT / "run" / "7" / "default" / "metadata").write_text('{{"step": 7}}')
    mngr = manager()
    print("  reopened + uncommitted run/7/: all_steps", mngr.all_steps(),
          "latest", mngr.latest_step())
    mngr.close()
except Exception as e:
    fail(e)
"""

ARRAYS = """
import numpy as np
ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler(),
                         temporary_path_class=CommitFileTemporaryPath)
item = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
try:
    t = time.monotonic()
    ckptr.save(ROOT / "arrays", args=ocp.args.StandardSave(item))
    print(f"  saved in {time.monotonic() - t:.1f} s; objects:", objects()[:6])
    got = ckptr.restore(ROOT / "arrays", args=ocp.args.StandardRestore(item))
    print("  restored equal:", bool((got["w"] == item["w"]).all()))
except Exception as e:
    fail(e)
"""

EPATH = """
d = ROOT / "empty"
for name, f in [
    ("mkdir", lambda: d.mkdir(parents=True)),
    ("exists", d.exists),
    ("is_dir", d.is_dir),
    ("iterdir", lambda: list(d.iterdir())),
    ("objects", objects),
    ("mkdir again exist_ok", lambda: d.mkdir(parents=True, exist_ok=True)),
    ("mkdir again", lambda: d.mkdir()),
    ("mkdir child", lambda: (d / "child").mkdir()),
    ("iterdir after child", lambda: [p.name for p in d.iterdir()]),
    ("rmtree", d.rmtree),
    ("exists after rmtree", d.exists),
    ("objects after rmtree", objects),
    ("write_text file", lambda: (ROOT / "x" / "f.txt").write_text("1")),
    ("prefix x exists/is_dir", lambda: ((ROOT / "x").exists(), (ROOT / "x").is_dir())),
    ("rename dir x -> y", lambda: (ROOT / "x").rename(ROOT / "y")),
    ("objects after rename", objects),
    ("rmtree missing", lambda: (ROOT / "nope").rmtree()),
    ("exists missing", (ROOT / "nope").exists),
]:
    try:
        print(f"  {{name}}: {{f()!r}}")
    except Exception as e:
        print(f"  {{name}}: {{type(e).__name__}} {{str(e)[:160]!r}}")
"""


def run(label, server, code):
    if ONLY and not any(o in label for o in ONLY):
        return
    bucket = f"probe-{uuid.uuid4().hex[:12]}"
    root = server.create_bucket(bucket)
    env = dict(os.environ, PROBE_ROOT=root, JAX_PLATFORMS="cpu")
    for k, v in server.env().items():
        env.pop(k, None) if v is None else env.__setitem__(k, v)
    t = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT,
        )
        out = p.stdout.rstrip()
        if p.returncode:
            out += f"\n  [rc={p.returncode}] " + p.stderr.strip()[-1500:]
    except subprocess.TimeoutExpired as e:
        out = f"  HANG: killed after {LIMIT} s; stdout so far: {e.stdout!r}"
    print(f"## {label} ({time.monotonic() - t:.1f} s)\n{out}", flush=True)


def main():
    s3, gcs = _servers.start()
    commit = "{'temporary_path_class': CommitFileTemporaryPath}"
    for server in (s3, gcs):
        k = server.scheme
        run(
            f"{k} Checkpointer + CommitFileTemporaryPath",
            server,
            CHECKPOINTER.replace("{TEMP}", commit),
        )
        run(f"{k} Checkpointer default", server, CHECKPOINTER.replace("{TEMP}", "{}"))
        for temp in (True, False):
            for asy in (False, True):
                label = (
                    f"{k} CheckpointManager temporary_path_class="
                    f"{'CommitFile' if temp else 'default'} async={asy}"
                )
                run(label, server, MANAGER.format(TEMP=temp, ASYNC=asy, CREATE=True))
        run(
            f"{k} CheckpointManager CommitFile create=False",
            server,
            MANAGER.format(TEMP=True, ASYNC=False, CREATE=False),
        )
        run(f"{k} epath empty directories", server, EPATH.format())
        run(f"{k} StandardCheckpointHandler arrays + CommitFile", server, ARRAYS)


if __name__ == "__main__":
    main()
