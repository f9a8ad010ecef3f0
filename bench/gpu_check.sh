#!/usr/bin/env bash
# One prepared check for a single GPU (made for a 15-minute window; it ends in under 8 minutes):
# device facts, the GPU tests, and the dispatch/combine table of bench/gpu_bench.py.
# Everything goes to $OUT (default bench/results/gpu); copy the table into docs/PERF.md with its
# date and device only from such a run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 MOE_COMM_TIMEOUT_S=30
export MOE_COMM_CACHE_DIR=${MOE_COMM_CACHE_DIR:-$PWD/.moe_comm_cache}

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, torch.version.cuda, 'triton', triton.__version__)"
  command -v nvcc >/dev/null && nvcc --version | tail -1
} 2>&1 | tee "$OUT/device.txt"

# moe_comm.kernels lives in kernels/: install the checkout in place (no downloads).
"$PY" -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -3 | tee "$OUT/install.txt"

timeout 300 "$PY" -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu.py tests/test_csrc.py \
  2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"

timeout 240 "$PY" bench/gpu_bench.py --out "$OUT/perf.md" 2>&1 | tee "$OUT/gpu_bench.txt"
