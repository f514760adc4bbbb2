#!/usr/bin/env bash
# Everything moelab checks on a lent CPU+GPU box, in one call and within a time budget. From the
# repository root:
#
#     OUT=box_out BUDGET=520 bash scripts/gpu_box_check.sh
#
# Order (each step gets what is left of BUDGET seconds, so the call ends inside the budget):
#   1. environment (GPU, CPU model and ISA flags, package versions) and the native kernels' build;
#   2. the CUDA tests (scripts/gpu_check.sh, SKIP_BENCH=1) and the kernels' parity / error-path
#      tests on every ISA path this CPU runs (scripts/cpu_isa_check.sh, SKIP_BENCH=1), side by side;
#   3. the real executor's CUDA bench (scripts/gpu_check.sh, SKIP_TESTS=1; HOST_BACKEND=moelab_bf16 and
#      DEVICE_BACKEND=batched_mm, transformers' fastest built-in on an H100, unless set), alone;
#   4. `moelab bench throughput --device cuda` (MoE-Gen's offloaded decode beside its simulation), alone;
#   5. `moelab bench kernels` (T=1 16 256) and `--prefill` on the best ISA path, alone.
# ONLY="errors bench kernels" runs just those steps (names: tests, cuda (the CUDA tests alone), errors, bench,
# throughput, kernels, prefill;
# the environment and the build always run). "errors" runs the kernels' error-path tests alone and, when the
# interpreter dies, a native backtrace under cuda-gdb (the image has no gdb).
# Timings on the H100 box of 2026-11-28 (16 cores, torch 2.11): kernels build 40 s; CUDA tests 100 s; the ISA
# tests (four paths, beside the CUDA tests) over 240 s; the error paths 60 s; the bench's model 58 s, then
# about 15 s per point; `bench kernels --tokens 1 16 256` over 100 s. A 15-minute lease (about 35 s to
# start each machine) fits two calls, e.g. ONLY="tests" BUDGET=360, then ONLY="errors bench kernels".
# On the H200 box of 2026-11-29 (16 cores, AMX, torch 2.11): kernels build 47-49 s; the CUDA tests 116 s beside
# the ISA tests (JOBS=8: amx 57 s, avx512 52 s of pytest per path, five paths; 200 s ran two and a half);
# test_hybrid_cuda.py alone did not finish in 90 s; the bench's model 58-62 s; `bench kernels --tokens 1 16 256
# --repeat 3` 68 s; `--prefill` over 60 s (cut). The first call started in about 35 s.
# 2026-11-30 (H200, the same kind of box): build 45-47 s; TESTS="tests/test_hybrid_cuda.py tests/test_plan_later.py"
# 81 s (28 tests, JOBS=8) beside ISAS=amx's 68 s; the bench's model 49-52 s, two points 30 s; `--prefill` (three
# dtypes, built-ins included) 77 s; a one-shape T=1 kernels bench about 25 s. A call of 273 s and one of 389 s
# fitted the 900 s budget with the starts.
# Results: $OUT/summary.txt (the figures) and $OUT/all.tgz (every log), so they fit the device
# tool's eight returned files. Exit status: non-zero when a test failed.
set -uo pipefail
OUT="${OUT:-${1:-gpu_box_out}}"
BUDGET="${BUDGET:-520}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$OUT/ext}"
PY="${PYTHON:-python3}"
S="$OUT/summary.txt"
: > "$S"

ONLY="${ONLY:-tests errors bench throughput kernels prefill}"
want() { [[ " $ONLY " == *" $1 "* ]]; }
grc=0; irc=0; erc=0

step() {  # step LIMIT_S CMD...: run CMD with min(LIMIT_S, the budget left); say when it was cut or skipped
  local lim=$1 left=$((BUDGET - SECONDS)); shift
  if [ "$left" -lt 15 ]; then echo "SKIPPED (budget spent): $*" | tee -a "$S" >&2; return 124; fi
  [ "$lim" -gt "$left" ] && lim=$left
  local t0=$SECONDS
  timeout "$lim" "$@"; local rc=$?
  echo "[${SECONDS}s] rc=$rc after $((SECONDS - t0)) s (limit $lim s): $*" >> "$S"
  return $rc
}

{
  echo "== box"; nvidia-smi -L 2>&1; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  grep -m1 "model name" /proc/cpuinfo; echo "cpus $(nproc)"
  grep -m1 -o -w -E "avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx512_fp16|amx_tile|amx_bf16|amx_int8" \
    /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  $PY -m pip list 2>/dev/null | grep -iE "^(torch|transformers|numba|numpy|pandas|pyarrow|pyyaml|tokenizers|safetensors|accelerate|pytest|pytest-xdist) "
} 2>&1 | tee -a "$S"

echo "== kernels build" | tee -a "$S"
step 200 $PY -c "import time; t = time.time(); from moelab.kernels.build import load_extension, supported_isas; load_extension(); print('ISA paths:', ' '.join(supported_isas()), f'(built in {time.time() - t:.0f} s)')" 2>&1 | tee -a "$S"
BEST=$($PY -c "from moelab.kernels import supported_isas; print(supported_isas()[0])" 2>/dev/null)
echo "best ISA path: ${BEST:-none}" | tee -a "$S"

if want cuda; then  # the CUDA tests alone (TESTS= narrows them; see scripts/gpu_check.sh)
echo "== CUDA tests" | tee -a "$S"
mkdir -p "$OUT/gpu"
OUT="$OUT/gpu" SKIP_BENCH=1 JOBS="${JOBS:-6}" step "${TESTS_S:-240}" bash scripts/gpu_check.sh > "$OUT/gpu/log.txt" 2>&1; grc=$?
{ echo "-- CUDA tests (rc $grc)"; grep -E "passed|failed|error|SKIPPED|FAILED|ERROR" "$OUT/gpu/pytest.txt" | tail -25; } 2>&1 | tee -a "$S"
fi

if want tests; then
echo "== tests (CUDA and ISA, side by side)" | tee -a "$S"
mkdir -p "$OUT/isa" "$OUT/gpu"
( OUT="$OUT/isa" JOBS="${JOBS:-6}" SKIP_BENCH=1 step "${TESTS_S:-240}" bash scripts/cpu_isa_check.sh > "$OUT/isa/log.txt" 2>&1 ) &
isa_pid=$!
OUT="$OUT/gpu" SKIP_BENCH=1 step "${TESTS_S:-240}" bash scripts/gpu_check.sh > "$OUT/gpu/log.txt" 2>&1; grc=$?
wait $isa_pid; irc=$?
pkill -9 -f "pytest" 2>/dev/null  # workers a timed-out step left behind
{ echo "-- CUDA tests (rc $grc)"; grep -E "passed|failed|error|SKIPPED|FAILED|ERROR" "$OUT/gpu/pytest.txt" | tail -25
  echo "-- ISA tests (rc $irc)"; for f in "$OUT"/isa/pytest-*.txt; do echo "$f"; grep -E "^(FAILED|ERROR)|passed|failed|crash" "$f" | tail -12; done; } 2>&1 | tee -a "$S"

fi

if want errors; then
echo "== kernels error paths (a crash is a failure, with its native backtrace)" | tee -a "$S"
step 120 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_errors.py > "$OUT/errors.txt" 2>&1; erc=$?
tail -4 "$OUT/errors.txt" | tee -a "$S"
for k in 0 1 2 3; do  # which exception kinds, thrown without tensor arguments, reach Python (3: ostream-formatted)
  r=$(timeout 60 $PY -c "from moelab.kernels.build import load_extension as l
try: l()._raise_probe($k)
except Exception as e: print(type(e).__name__, e)" 2>&1 | tail -1); echo "probe $k (exit $?): $r" | tee -a "$S"
done
if [ $erc -ne 0 ] && command -v cuda-gdb > /dev/null; then
  $PY - > "$OUT/crash.py" <<'PYEOF'
import tests.test_kernels_errors as t; print(t.SCRIPT)
PYEOF
  step 90 cuda-gdb -batch -ex "set pagination off" -ex run -ex bt -ex "info sharedlibrary" --args $PY "$OUT/crash.py" > "$OUT/crash-bt.txt" 2>&1
  grep -E "^#|signal|SIG" "$OUT/crash-bt.txt" | head -40 | tee -a "$S"
fi
fi

if want bench; then
echo "== real executor on CUDA (host backend ${HOST_BACKEND:-moelab_bf16})" | tee -a "$S"
mkdir -p "$OUT/bench"
POINTS="${POINTS:-1:0 0.25:0 0.25:2 0:0 0:2}" THREADS="${THREADS:-$(nproc)}" HOST_BACKEND="${HOST_BACKEND:-moelab_bf16}" DEVICE_BACKEND="${DEVICE_BACKEND:-batched_mm}" OUT="$OUT/bench" SKIP_TESTS=1 step 200 bash scripts/gpu_check.sh \
  > "$OUT/bench/log.txt" 2>&1
grep -vE "^== environment|^python |^cuda |^plotly|^lm_eval|^ray|^imports" "$OUT/bench/bench.txt" 2>/dev/null | tee -a "$S"

fi

if want throughput; then
echo "== MoE-Gen offloaded decode on CUDA (moelab bench throughput --device cuda)" | tee -a "$S"
step 120 $PY -m moelab.cli bench throughput --device cuda --models moelab-tiny-mixtral v2-lite:2 --batches 32 \
  --micro-batches 8 --expert-batches 64 --steps 4 --repeats 3 --expert-slots 2 --allow-busy \
  > "$OUT/throughput.txt" 2> "$OUT/throughput.log"
cat "$OUT/throughput.txt" >> "$S"; tail -3 "$OUT/throughput.log" >> "$S"
fi

if [ -n "$BEST" ]; then
  for mode in tokens prefill; do
    want "${mode/tokens/kernels}" || continue
    echo "== moelab bench kernels ($mode) on $BEST" | tee -a "$S"
    args=(--tokens 1 16 256); [ $mode = prefill ] && args=(--prefill)
    MOELAB_KERNELS_ISA=$BEST step 150 $PY -m moelab.cli bench kernels --dtypes bf16 int8 fp8 "${args[@]}" \
      --repeat "${REPEAT:-3}" --allow-busy > "$OUT/kernels-$mode.txt" 2> "$OUT/kernels-$mode.log"
    cat "$OUT/kernels-$mode.txt" >> "$S"
  done
fi

rm -rf "$OUT/ext" "$OUT/isa/ext"
tar czf /tmp/moelab-box-all.tgz -C "$OUT" --exclude=summary.txt . && mv /tmp/moelab-box-all.tgz "$OUT/all.tgz" \
  && (cd "$OUT" && rm -rf isa gpu bench kernels-* throughput.* errors.txt crash*)
echo "== done in ${SECONDS} s; CUDA tests rc $grc, ISA tests rc $irc, error paths rc $erc" | tee -a "$S"
exit $(( grc != 0 ? grc : irc != 0 ? irc : erc ))
