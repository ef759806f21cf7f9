#!/usr/bin/env bash
# The GPU check on a machine that brings its own PyTorch with CUDA (Python 3.12, no network): the
# wheels of scripts/gpu-wheels.sh (.whl) and gen/ carried beside the repository. Writes the JSON
# results and the log to the folder given (default bench/results), and prints the table last; further
# arguments go to `python -m bench.gpu` (e.g. --sections parity,short_job).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-bench/results}
shift || true
mkdir -p "$out"
source scripts/gpu-env.sh > "$out/gpu-env.log" 2>&1 || { cat "$out/gpu-env.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
df -h /dev/shm /tmp || true
python3 -m bench.gpu --device cuda --out "$out/gpu.json" --work-dir /tmp/rlmesh-gpu "$@"
