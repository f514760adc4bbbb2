#!/usr/bin/env bash
# The native CPU kernels' checks on every instruction-set path this CPU runs, for an AVX-512 /
# AVX512-BF16 (/ AMX) machine. From the repository root:
#
#     OUT=isa_out bash scripts/cpu_isa_check.sh        # or: bash scripts/cpu_isa_check.sh isa_out
#
# Uses $PYTHON (default python3; torch, transformers, pytest, pytest-xdist) with PYTHONPATH=. (no
# install); the kernels are built on first use into $TORCH_EXTENSIONS_DIR (default $OUT/ext).
# Writes to $OUT: env.txt (versions, CPU flags, the ISA paths moelab detects), pytest-<isa>.txt (the
# kernel parity, regime and error-path tests with MOELAB_KERNELS_ISA=<isa>, for each supported path),
# bench-<isa>.txt / .json (`moelab bench kernels` bf16/int8/fp8 at T=1 16 256 on that path) and
# prefill-<isa>.txt / .json (`--prefill`), and for the avx2 / avx512vnni / avx512 paths below the CPU's best also
# bench-<isa>-emulated.txt / .json (`--emulate <isa>`: transformers' built-ins held to that instruction
# set too, as on a CPU whose best it is; EMULATE=0 skips them). Exit status: non-zero when a test failed.
# SKIP_BENCH=1 runs the tests only; REPEAT=N bench repetitions (5); JOBS=N pytest workers (4); ISAS="amx" those paths only.
# On an AMX CPU the paths are amx (bf16/fp8 experts with >= 16 tokens on tiles), avx512, avx512vnni, avx2, portable;
# on a Cascade Lake or Ice Lake one avx512vnni, avx2, portable.
set -uo pipefail
OUT="${OUT:-${1:-cpu_isa_check_out}}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$OUT/ext}"
PY="${PYTHON:-python3}"
REPEAT="${REPEAT:-5}"
JOBS="${JOBS:-4}"
status=0

echo "== environment" | tee "$OUT/env.txt"
{
  $PY -c "import platform, torch, transformers; print('python', platform.python_version(), 'torch', torch.__version__, 'transformers', transformers.__version__, 'threads', torch.get_num_threads())"
  grep -m1 "model name" /proc/cpuinfo
  grep -m1 -o -w -E "avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512dq|avx512_vnni|avx512_bf16|avx512vbmi|amx_tile|amx_bf16|amx_int8" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
} 2>&1 | tee -a "$OUT/env.txt"
ALL=$($PY -c "from moelab.kernels import supported_isas; print(' '.join(supported_isas()))") || { echo "building the kernels failed"; exit 1; }
ISAS="${ISAS:-$ALL}"  # ISAS="amx avx512" narrows the paths (each must be one this CPU runs)
echo "moelab ISA paths: $ISAS" | tee -a "$OUT/env.txt"

for isa in $ISAS; do
  echo "== tests, MOELAB_KERNELS_ISA=$isa"
  MOELAB_KERNELS_ISA=$isa $PY -m pytest -q -n "$JOBS" -p no:cacheprovider \
    tests/test_kernels_parity.py tests/test_kernels_regimes.py tests/test_kernels_errors.py \
    tests/test_kernels_fp8.py tests/test_kernels_quant.py tests/test_kernels_integration.py tests/test_kernels_native_lane.py \
    2>&1 | tee "$OUT/pytest-$isa.txt" | tail -5
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

if [ -z "${SKIP_BENCH:-}" ]; then
  for isa in $ISAS; do
    [ "$isa" = portable ] && continue  # the portable path is a correctness reference, not a fast path
    echo "== bench, MOELAB_KERNELS_ISA=$isa"
    for mode in bench prefill; do
      args=(--tokens 1 16 256); [ $mode = prefill ] && args=(--prefill)
      MOELAB_KERNELS_ISA=$isa $PY -m moelab.cli bench kernels --dtypes bf16 int8 fp8 "${args[@]}" \
        --repeat "$REPEAT" --allow-busy --json > "$OUT/$mode-$isa.json" 2> "$OUT/$mode-$isa.log"
      $PY -c "import json, sys; from moelab.kernels.bench import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
        "$OUT/$mode-$isa.json" | tee "$OUT/$mode-$isa.txt"
    done
    if [ "${EMULATE:-1}" != 0 ] && [ "$isa" != "${ISAS%% *}" ] && { [ "$isa" = avx2 ] || [ "$isa" = avx512 ] || [ "$isa" = avx512vnni ]; }; then
      echo "== bench, --emulate $isa (the built-ins held to $isa too)"
      $PY -m moelab.cli bench kernels --emulate "$isa" --dtypes bf16 int8 fp8 --tokens 1 16 256 \
        --repeat "$REPEAT" --allow-busy --json > "$OUT/bench-$isa-emulated.json" 2> "$OUT/bench-$isa-emulated.log"
      $PY -c "import json, sys; from moelab.kernels.bench import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
        "$OUT/bench-$isa-emulated.json" | tee "$OUT/bench-$isa-emulated.txt"
    fi
  done
fi
echo "== done: $([ $status -eq 0 ] && echo all tests passed || echo TESTS FAILED); results in $OUT"
exit $status
