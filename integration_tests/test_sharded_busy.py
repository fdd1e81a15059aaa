"""400 sharded arrays on 8 CPU devices, saved while both cores are busy.

A save used to dispatch a jitted reduction over every sharded array; on CPU
devices these collectives wait for all 8 device threads, and with the
machine busy (and on an idle one from 50 arrays) XLA aborted the interpreter
("Termination timeout for all reduce"). Now a save compiles and runs
nothing on any device: the worker counts XLA compilations during the save,
with two busy-looping processes holding both cores, and fails past a time
limit (SIGKILL) rather than stalling the run.
"""

import subprocess
import sys

from . import _procs

BUSY = "import time\nend = time.time() + 300\nwhile time.time() < end: pass\n"


def test_400_sharded_arrays_save_on_a_busy_machine_without_computing(tmp_path):
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        (text,) = _procs.run(
            "_busy_worker.py",
            "save",
            str(tmp_path / "ckpt"),
            devices=8,
            log_dir=tmp_path,
            timeout=240,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert "compiled 0 in a save" in text, text
    assert text.rstrip().endswith("ok"), text
