"""Runs restores and commands on a hostile checkpoint in a fresh interpreter.

What could crash (an allocation of terabytes: `std::bad_alloc`), block (a
FIFO) or read without end (`/dev/zero`) runs in a child process with a time
limit (then SIGKILL) and, for `run_child`, a memory limit, so that a
regression fails the test (with the stack of a hang, from `faulthandler`)
instead of killing pytest, hanging it or filling the machine's memory.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import orbax_eqx as oeqx

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(oeqx.__file__)))
LIMIT_S = 120  # for a child that imports JAX and runs a few commands
MEMORY = 3 << 30  # a child's address space: reading /dev/zero ends here


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": PACKAGE_ROOT}


_RESTORE = textwrap.dedent(
    """
    import json, os, sys
    import orbax_eqx as oeqx

    path, warm, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run = getattr(oeqx, sys.argv[4])  # restore, or verify
    if warm:  # loads every module a restore needs, before losing access to them
        run(warm)
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    try:
        run(path)
    except Exception as e:
        print(json.dumps({"type": type(e).__name__, "message": str(e)}))
    else:
        print(json.dumps({"type": None, "message": ""}))
    """
)


def restore_in_child(path, warm="", uid=-1, run="restore") -> dict:
    """Restores in a fresh interpreter: a crash there (std::bad_alloc) fails the test
    without killing pytest. `uid >= 0`: the restore runs as that user. `run`:
    `"verify"` to verify instead. Returns {"type": error class name or None,
    "message": its text}."""
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE, str(path), str(warm), str(uid), run],
        capture_output=True,
        text=True,
        env=_env(),
        cwd="/",
        timeout=300,
    )
    assert proc.returncode == 0, f"the restore crashed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Runs restore, verify and export through the API on `spec["path"]` (if
# given), then each command line of `spec["cli"]` through the `orbax-eqx`
# console script; prints one JSON line per run as it ends.
_COMMANDS = textwrap.dedent(
    """
    import contextlib, faulthandler, io, json, resource, sys
    # A hang prints every thread's stack and ends the child: the test shows it.
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
    # An endless read ends in MemoryError here, not with the machine's memory.
    memory = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    from importlib.metadata import entry_points
    import orbax_eqx as oeqx

    (script,) = entry_points(group="console_scripts", name="orbax-eqx")
    main = script.load()
    spec = json.loads(sys.argv[3])

    def report(name, **result):
        print(json.dumps({"run": name, **result}), flush=True)

    def attempt(name, fn):
        try:
            value = fn()
        except Exception as e:
            report(name, type=type(e).__name__, message=str(e))
        else:
            report(name, type=None, value=value)

    if "path" in spec:
        path, out = spec["path"], spec["out"]
        attempt("restore", lambda: sorted(oeqx.restore(path)))
        attempt("verify", lambda: [d.problem for d in oeqx.verify(path).damaged])
        attempt("export", lambda: oeqx.export_safetensors(path, out).files)
    for name, argv in spec["cli"].items():
        err, printed = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(printed):
            code = main(argv)
        report(name, code=code, stderr=err.getvalue(), stdout=printed.getvalue())
    """
)


def run_child(**spec) -> dict:
    """Runs restore, verify and export of `spec["path"]` (into `spec["out"]`)
    if given, then each command line of `spec["cli"]` ({name: argv}); returns
    {run: result}. Fails the test on a hang or a crash."""
    argv = [str(LIMIT_S - 20), str(MEMORY), json.dumps(spec)]
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _COMMANDS, *argv],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=LIMIT_S,  # then SIGKILL: a stuck read ignores anything else
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"blocked past {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"the child failed:\n{proc.stdout}\n{proc.stderr}"
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line]
    return {r.pop("run"): r for r in runs}
