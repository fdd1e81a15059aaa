#!/usr/bin/env bash
# The GPU figures, in one command, on a machine with one accelerator:
#
#   bash benchmarks/gpu.sh [OUT_DIR]
#
# 1. prints the machine and the versions it ran with;
# 2. runs the recorded GPU benchmark (BENCHMARKS.md, "GPU"):
#    `python benchmarks/run.py --only a,b --repeats 3 --json OUT_DIR/bench-gpu.json`;
# 3. runs the staging and round-trip tests on the accelerator (CI never has
#    one: there CPU devices copy through a `max_staged_bytes` window).
#
# Each process gets at most 35% of the GPU's memory: the benchmark's
# fresh-process probes run while the benchmark itself still holds its share
# (JAX preallocates 75% by default, and a second process would then fail).
set -uo pipefail
out="${1:-.}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.35}"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$python" - <<'EOF'
import sys, jax, jaxlib, equinox, orbax.checkpoint as ocp
from importlib.metadata import version
print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib "
      f"{jaxlib.__version__}, orbax-checkpoint {ocp.__version__}, equinox "
      f"{equinox.__version__}, tensorstore {version('tensorstore')}")
print("devices:", jax.devices())
EOF

status=0
timeout 420 "$python" benchmarks/run.py --only a,b --repeats 3 \
    --json "$out/bench-gpu.json" 2>&1 | tee "$out/bench-gpu.log" || status=1

# The tests that exercise what only an accelerator does for real: staged
# restores through the window, gathered device-to-host copies, round trips.
timeout 150 "$python" -m pytest -p no:xdist -p no:cacheprovider -q \
    tests/test_staging.py tests/test_roundtrip.py 2>&1 \
    | tee "$out/tests-gpu.log" || status=1
exit "$status"
