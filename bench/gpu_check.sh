#!/usr/bin/env bash
# One prepared check for a single lent GPU (a 15-minute window, 10 minutes per command): the
# versions and device facts, every kernel variant compiled ahead (in parallel, timed), the
# csrc/ kernels' GPU tests, ranks as processes sharing the GPU (tests/test_gpu_processes.py:
# the proxy's GPU half, NVSHMEM puts, the cuda heap), the checked dispatch/combine table of
# bench/gpu_bench.py with each kernel's device time and the gate's model fitted to it
# (bench/fit_model.py), then the virtual-rank GPU tests, each with its own time limit. The whole
# script ends within GPU_CHECK_BUDGET_S (default 470 s, under 8 minutes); a phase that would overrun gets a shorter
# limit or is skipped, and said so. Nothing stops it early: every failure is reported, the
# summary lists each phase with its time and status, and the exit status is 1 if anything
# failed. Everything goes to $OUT (default bench/results/gpu); copy the table into docs/PERF.md
# with its date and device only from such a run. Wheels in .whl/ (`make gpu-wheels`: nvshmem4py
# and nixl-cu13, which the GPU image lacks; ignored by git, so name .whl in the run's carry) are
# installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
TEST_TIMEOUT_S=${GPU_TEST_TIMEOUT_S:-120}
JOBS=${GPU_CHECK_JOBS:-16}
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 MOE_COMM_TIMEOUT_S=30
# each failure printed as it happens (tests/conftest.py): a phase killed at its limit still says why
export MOE_COMM_FAILURES_AT_ONCE=1
export MOE_COMM_CACHE_DIR=${MOE_COMM_CACHE_DIR:-$PWD/.moe_comm_cache}
# the gate compiles into this cache and the tests and the benchmark launch from it
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
SECONDS=0
FAILED=()
SUMMARY=()

note() { echo "== $(date -u +%H:%M:%S) (+${SECONDS}s) $*"; }
# limit CAP RESERVE: seconds for a phase, at most CAP, leaving RESERVE for the phases after it
limit() {
  local t=$((BUDGET_S - SECONDS - $2))
  (( t > $1 )) && t=$1
  echo "$t"
}
done_phase() {  # done_phase NAME START_SECONDS STATUS: a status not starting with ok fails
  SUMMARY+=("$(printf '%-8s %4ss  %s' "$1" "$((SECONDS - $2))" "$3")")
  [[ $3 == ok* ]] || FAILED+=("$1")
}
cache_entries() { find "$TRITON_CACHE_DIR" -mindepth 1 -maxdepth 1 -type d | wc -l; }

# ---------------------------------------------------------------------------- versions, device
start=$SECONDS
note "versions and device" | tee "$OUT/device.txt"
{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,compute_cap \
    --format=csv 2>&1 || echo "nvidia-smi failed"
  timeout 120 "$PY" bench/gpu_prepare.py facts
} 2>&1 | tee -a "$OUT/device.txt"
ARCH=$(sed -n 's/^arch=\([0-9]*\)$/\1/p' "$OUT/device.txt" | head -1)
if [[ -n $ARCH ]]; then done_phase facts "$start" ok; else ARCH=90; done_phase facts "$start" \
  "FAIL: no CUDA device seen (arch 90 assumed)"; fi
cat <<EOF
== plan: budget ${BUDGET_S}s; compile ahead for sm_${ARCH} on ${JOBS} processes (the CPU-only
   gate of this tree records about 230 variants per arch at ~0.4 s of compiling each, the
   NVSHMEM-linked ones a few seconds: roughly 230 x 0.4 / ${JOBS} + recording and worker start,
   30-90 s), the csrc/ cubin for sm_${ARCH} alongside (nvcc, 30-90 s when not cached);
   then the GPU tests (limit ${TEST_TIMEOUT_S}s each) with the benchmark (~1-2 min).
EOF

# ---------------------------------------------------------------------------- install
start=$SECONDS
note "install the checkout in place (csrc/ is built for sm_${ARCH} only, next phase)"
# moe_comm.kernels lives in kernels/: install the checkout in place (no downloads).
MOE_COMM_BUILD_CUDA=0 timeout 300 "$PY" -m pip install --no-deps --no-build-isolation -q -e . \
  2>&1 | tail -3 | tee "$OUT/install.txt"
rc=${PIPESTATUS[0]}
if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels (make gpu-wheels): nvshmem4py
  SITE=/tmp/moe_comm_site
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl 2>&1 | tail -3 | tee -a "$OUT/install.txt"
  (( PIPESTATUS[0] )) && rc=1
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  echo "carried wheels installed: $(cd .whl && ls ./*.whl | tr '\n' ' ')" | tee -a "$OUT/install.txt"
else
  echo "no carried wheels in .whl/ (make gpu-wheels): the NVSHMEM-heap tests will skip" \
    | tee -a "$OUT/install.txt"
fi
if [[ $rc == 0 ]]; then done_phase install "$start" ok; else done_phase install "$start" \
  "FAIL (rc $rc)"; fi
timeout 60 "$PY" bench/gpu_prepare.py toolchain --arch "$ARCH" 2>&1 | tee -a "$OUT/device.txt"
BITCODE_RC=${PIPESTATUS[0]}

# ---------------------------------------------------------------------------- compile ahead
start=$SECONDS
T=$(limit 240 220)
(( T < 20 )) && T=20  # a short compile phase still saves the tests most of their compiling
note "compile every runtime specialisation for sm_${ARCH} (limit ${T}s; Triton cache" \
  "$TRITON_CACHE_DIR: $(cache_entries) entries)"
NVSHMEM_SKIPPED=""
if [[ $BITCODE_RC == 0 ]]; then
  GATE=(-m moe_comm.testing.gate --arch "$ARCH" --jobs "$JOBS" --out "$OUT/gpu_gate.tsv"
        --config small dsv3-prefill dsv3-decode)
else
  echo "NVSHMEM bitcode unusable here (see above): the gate compiles everything else"
  NVSHMEM_SKIPPED=$(grep -m1 "bitcode.*unusable" "$OUT/device.txt" | cut -c1-200)
  NVSHMEM_SKIPPED=${NVSHMEM_SKIPPED:-toolchain check failed}
  GATE=(bench/gpu_prepare.py gate --no-nvshmem --arch "$ARCH" --jobs "$JOBS"
        --out "$OUT/gpu_gate.tsv")
fi
( gate_start=$SECONDS
  timeout "$T" "$PY" "${GATE[@]}" > "$OUT/gpu_gate.txt" 2>&1
  echo "gate exit status $? after $((SECONDS - gate_start)) s" >> "$OUT/gpu_gate.txt" ) &
GATE_PID=$!
( timeout "$T" "$PY" bench/gpu_prepare.py csrc --arch "$ARCH" > "$OUT/csrc_build.txt" 2>&1
  echo "csrc exit status $?" >> "$OUT/csrc_build.txt" ) &
CSRC_PID=$!
wait "$GATE_PID" "$CSRC_PID"
grep -E "^gate:|^FAIL|exit status|Error" "$OUT/gpu_gate.txt" | tail -25
cat "$OUT/csrc_build.txt"
if [[ $BITCODE_RC == 0 ]] && ! grep -q "variants recorded" "$OUT/gpu_gate.txt"; then
  # the gate stopped before compiling (e.g. while recording the NVSHMEM flavour): again
  # without it, so that the tests and the benchmark still find their kernels compiled
  T=$(limit 150 220)
  if (( T >= 30 )); then
    echo "the gate recorded nothing (see $OUT/gpu_gate.txt); again without NVSHMEM (${T}s)"
    NVSHMEM_SKIPPED="the gate stopped before compiling: $(grep -m1 -E "Error|error:" \
      "$OUT/gpu_gate.txt" | cut -c1-200)"
    retry_start=$SECONDS
    timeout "$T" "$PY" bench/gpu_prepare.py gate --no-nvshmem --arch "$ARCH" --jobs "$JOBS" \
      --out "$OUT/gpu_gate.tsv" > "$OUT/gpu_gate_retry.txt" 2>&1
    echo "gate exit status $? after $((SECONDS - retry_start)) s" >> "$OUT/gpu_gate_retry.txt"
    grep -E "^gate:|^FAIL|exit status" "$OUT/gpu_gate_retry.txt" | tail -15
  fi
fi
GATE_STATUS=$(grep -h "exit status" "$OUT/gpu_gate.txt" "$OUT/gpu_gate_retry.txt" 2>/dev/null \
  | tail -1)
# NVSHMEM-flavour rows of the TSV (the variant shows TRANSPORT=1): all / failing (the status
# is the last column)
NVSHMEM_ROWS=$(awk -F'\t' 'NR > 1 && $4 ~ /TRANSPORT=1/ {n++; if ($NF != "ok") f++}
  END {printf "%d rows, %d failing", n, f}' "$OUT/gpu_gate.tsv" 2>/dev/null)
echo "gate: ${GATE_STATUS:-no status}; NVSHMEM-flavour variants: ${NVSHMEM_ROWS:-none};" \
  "Triton cache now $(cache_entries) entries"
if [[ -n $NVSHMEM_SKIPPED ]]; then
  echo "NVSHMEM flavour NOT compiled: $NVSHMEM_SKIPPED"
  done_phase compile "$start" "FAIL: NVSHMEM flavour not compiled ($NVSHMEM_SKIPPED); the
           rest: ${GATE_STATUS:-the gate did not finish}"
elif [[ $GATE_STATUS == "gate exit status 0 "* ]]; then
  done_phase compile "$start" ok
else
  done_phase compile "$start" "FAIL: ${GATE_STATUS:-the gate did not finish}; NVSHMEM-flavour
           variants: ${NVSHMEM_ROWS:-none} (see gpu_gate.txt, gpu_gate.tsv)"
fi
# not a failure by itself: the kernel_impl='cuda' tests report what it means
SUMMARY+=("$(printf '%-8s %5s  %s' cubin '' "$(head -1 "$OUT/csrc_build.txt")")")

# ---------------------------------------------------------------------------- processes
# one process per rank sharing the GPU (no MPS: their kernels take turns, so what it prints are
# first-call and warm-up times, not performance): the cuda heap (2 and 4 processes), then
# NVSHMEM puts between 2 processes, then the proxy's GPU half; each its own phase and limit
PT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PT=(--timeout=120)
: > "$OUT/gpu_processes.log"
procs_phase() {  # procs_phase NAME CAP RESERVE -k EXPRESSION
  local start=$SECONDS t rc P N log=$OUT/gpu_processes.log
  t=$(limit "$2" "$3")
  if (( t < 40 )); then done_phase "$1" "$start" "FAIL: skipped, ${t}s left"; return; fi
  note "ranks as processes on one GPU: $1 (limit ${t}s)"
  echo "=== $1" >> "$log"
  timeout "$t" "$PY" -m pytest -v -s -p no:cacheprovider -o console_output_style=classic \
    "${PT[@]}" -rfEs --tb=short -m gpu -k "$5" tests/test_gpu_processes.py > "$log.part" 2>&1
  rc=$?
  cat "$log.part" >> "$log"
  grep -E "mapping|^(FAILED|ERROR)|^E  " "$log.part" | head -30
  P=$(grep -cE "::.* PASSED" "$log.part")
  N=$(grep -cE "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$log.part")
  rm -f "$log.part"
  if [[ $rc == 0 ]] && (( N > 0 && P == N )); then done_phase "$1" "$start" "ok: $P/$N passed"
  else done_phase "$1" "$start" \
    "FAIL (rc $rc$([[ $rc == 124 ]] && echo ': time limit')): $P of $N passed"; fi
}

# ---------------------------------------------------------------------------- GPU tests
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
tests_phase() {  # tests_phase NAME CAP RESERVE FILE...: the virtual-rank GPU tests of FILEs
  local name=$1 start=$SECONDS reserve=$3 T t rc id tag=$OUT/gpu_tests_$1 collected tests_rc
  T=$(limit "$2" "$reserve")
  (( T < 30 )) && T=30
  shift 3
  note "GPU tests: $name (limit ${TEST_TIMEOUT_S}s each, ${T}s in all)"
  timeout 120 "$PY" -m pytest --collect-only -q -p no:cacheprovider -m gpu "$@" \
    > "$tag.collect" 2>&1
  grep "::" "$tag.collect" > "$tag.ids"
  collected=$(wc -l < "$tag.ids")
  echo "$collected tests collected; $(tail -1 "$tag.collect")"
  (( collected )) || tail -30 "$tag.collect"
  : > "$tag.log"
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout "$T" "$PY" -m pytest -v -p no:cacheprovider -o console_output_style=classic \
      --timeout="$TEST_TIMEOUT_S" -rfEs --tb=short -m gpu "$@" >> "$tag.log" 2>&1
    echo "pytest exit status $? after $((SECONDS - start)) s" >> "$tag.log"
  else
    echo "pytest-timeout is not installed: one process per test" | tee -a "$tag.log"
  fi
  # tests without a result (no pytest-timeout, or pytest killed): one process each, while time
  # is left (the phases after it keep their reserve)
  "$PY" bench/gpu_prepare.py results --ids "$tag.ids" --log "$tag.log" --out "$tag.txt" \
    > "$tag.missing"
  while read -r id; do
    t=$(limit "$TEST_TIMEOUT_S" "$reserve")
    if (( t < 20 )); then echo "out of time: $id not run" | tee -a "$tag.log"; continue; fi
    timeout "$t" "$PY" -m pytest -v -p no:cacheprovider -o console_output_style=classic -rfEs \
      --tb=short "$id" >> "$tag.log" 2>&1 < /dev/null
    rc=$?
    (( rc == 124 )) && echo "$id FAILED (killed after ${t}s)" >> "$tag.log"
  done < "$tag.missing"
  "$PY" bench/gpu_prepare.py results --ids "$tag.ids" --log "$tag.log" --out "$tag.txt" \
    > /dev/null
  tests_rc=$?
  grep -E "^(FAILED|ERROR|SKIPPED)|^E  |Timeout" "$tag.log" | head -40
  cat "$tag.txt"
  if (( collected == 0 )); then done_phase "$name" "$start" "FAIL: no test collected"
  elif [[ $tests_rc == 0 ]]; then done_phase "$name" "$start" "ok: $(tail -1 "$tag.txt")"
  else done_phase "$name" "$start" "FAIL: $(tail -1 "$tag.txt")"; fi
}
# first what failed or was not reached on the last runs: the csrc/ kernels' GPU tests, the
# proxy's GPU half, NVSHMEM puts, the cuda heap (warm-up after real calls); then the benchmark
# and the fit; then the virtual-rank tests of the Triton kernels in the time left
tests_phase csrc 60 300 tests/test_csrc.py
procs_phase proxy 60 240 -k proxy
procs_phase nvshmem 50 200 -k nvshmem
procs_phase procs 80 160 -k "not nvshmem and not proxy"
# ---------------------------------------------------------------------------- benchmark, fit
# after what failed or was not reached before: the timings and each kernel's device time are
# what the gate's model is fitted to (bench/fit_model.py against the gate's gpu_gate_paths.tsv
# of the same tree)
start=$SECONDS
T=$(limit 150 10)
if (( T >= 30 )); then
  note "benchmark (limit ${T}s)"
  timeout "$T" "$PY" bench/gpu_bench.py --out "$OUT/perf.md" --kernels-tsv "$OUT/kernels.tsv" \
    2>&1 | tee "$OUT/gpu_bench.txt"
  rc=${PIPESTATUS[0]}
  if [[ $rc == 0 ]]; then done_phase bench "$start" ok; else done_phase bench "$start" \
    "FAIL (rc $rc$([[ $rc == 124 ]] && echo ': time limit'))"; fi
else
  done_phase bench "$start" "FAIL: skipped, ${T}s left"
fi
start=$SECONDS
if [[ -s $OUT/kernels.tsv && -s $OUT/gpu_gate_paths.tsv ]]; then
  note "the gate's model against this run's kernel times"
  timeout 60 "$PY" bench/fit_model.py --fit "$OUT/kernels.tsv" "$OUT/gpu_gate_paths.tsv" \
    2>&1 | tee "$OUT/fit.txt"
  rc=${PIPESTATUS[0]}
  # not a failure by itself: the model's error is a finding, printed in the summary
  SUMMARY+=("$(printf '%-8s %4ss  %s' fit "$((SECONDS - start))" \
    "rc $rc: $(grep -m1 -i "worst" "$OUT/fit.txt" | cut -c1-120)")")
else
  SUMMARY+=("$(printf '%-8s %5s  %s' fit '' "no kernels.tsv or gpu_gate_paths.tsv: not fitted")")
fi

tests_phase tests 200 0 tests/test_gpu.py
echo "Triton cache now $(cache_entries) entries (new ones were compiled by the tests themselves)"

# ---------------------------------------------------------------------------- summary
{
  echo "== summary (sm_${ARCH}, $(date -u +%H:%M:%S) UTC)"
  printf '  %s\n' "${SUMMARY[@]}"
  echo "total wall time: ${SECONDS} s (budget ${BUDGET_S} s)"
  if (( ${#FAILED[@]} )); then echo "FAILED: ${FAILED[*]}"; else echo "all phases ok"; fi
} | tee "$OUT/summary.txt"
(( ${#FAILED[@]} == 0 ))
