"""Runs worker scripts in fresh processes: fake CPU devices, `jax.distributed`
on loopback, a log file per worker, a timeout, and no process left behind.

JAX fixes its device count and its process group when it starts, so every
topology a test needs is a new set of processes. Test side only (stdlib);
the workers use `_worker.py`.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Workers must import this checkout's package, even when another one is
# installed in the environment (an editable install of a sibling worktree).
REPO_ROOT = HERE.parent
TAIL_CHARS = 6000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(devices: int) -> dict[str, str]:
    """This environment, with `devices` fake CPU devices and this checkout first."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "XLA_FLAGS")
    }
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    path = [str(REPO_ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(
    script: str,
    *args: str,
    devices: int,
    log_dir: Path,
    processes: int = 1,
    timeout: float = 120,
) -> list[str]:
    """Runs `script` in `processes` processes; returns each one's log.

    With more than one process, each gets `--process-id`, `--processes` and
    `--port` (a free coordinator port) after `args`, for `jax.distributed`.
    Fails the test, showing every worker's log, if any worker fails or the
    group runs past `timeout` seconds; the rest are killed at once.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    name = Path(script).stem
    try:
        for i in range(processes):
            argv = [sys.executable, str(HERE / script), *map(str, args)]
            if processes > 1:
                argv += ["--process-id", str(i), "--processes", str(processes)]
                argv += ["--port", str(port)]
            log = log_dir / f"{name}-{args[0] if args else 'run'}-{i}.log"
            logs.append(log)
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=worker_env(devices),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=log_dir,
                        start_new_session=True,  # its own group, killed as one
                    )
                )
        failure = _wait(procs, timeout)
    finally:
        for p in procs:
            _kill(p)
    texts = [log.read_text() for log in logs]
    if failure:
        shown = "\n".join(
            f"----- worker {i} ({log}), exit {p.returncode} -----\n{text[-TAIL_CHARS:]}"
            for i, (p, log, text) in enumerate(zip(procs, logs, texts, strict=True))
        )
        raise AssertionError(f"{script} {' '.join(map(str, args))}: {failure}\n{shown}")
    return texts


def _wait(procs: list[subprocess.Popen], timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return f"worker {failed[0]} exited with {codes[failed[0]]}"
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s"
        time.sleep(0.05)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
