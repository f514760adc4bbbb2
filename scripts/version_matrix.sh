#!/usr/bin/env bash
# One row of the README's supported-versions matrix: the test suite in a fresh environment that is
# the lock (requirements/lock.txt) except for the given pins and their companions.
#
#   scripts/version_matrix.sh transformers==5.17.0            # the whole suite (about 7-13 min)
#   TESTS="tests/test_compat.py tests/test_version_canaries.py" scripts/version_matrix.sh lm-eval==0.4.9
#
# Writes .venv-matrix/<row>/{resolved.txt,pytest.log}; the exit status is the suite's.
# Companions: packages whose pins follow the pinned one (transformers: tokenizers,
# huggingface-hub, ...; lm-eval: its evaluation dependencies); RELAX="a b" relaxes more.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
LOCK=${LOCK:-requirements/lock.txt}
TESTS=${TESTS:-tests}
row=$(echo "$*" | tr ' =' '_-' | tr -s '-')
venv=.venv-matrix/$row
relax="${RELAX:-}"
for pin in "$@"; do
  name=${pin%%[=<>!~]*}
  relax="$relax $name"
  case "$name" in
    transformers) relax="$relax tokenizers huggingface-hub hf-xet typer typer-slim regex safetensors accelerate" ;;
    lm-eval|lm_eval) relax="$relax datasets evaluate transformers tokenizers huggingface-hub hf-xet pytablewriter sacrebleu rouge-score accelerate peft" ;;
  esac
done
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
"$PYTHON" scripts/lock.py relax "$LOCK" $relax > "$venv/constraints.txt"
py=$venv/bin/python
$py -m pip install -q -c "$venv/constraints.txt" pip setuptools wheel
$py -m pip install -q -c "$venv/constraints.txt" "$TORCH"
$py -m pip install -q -c "$venv/constraints.txt" --no-build-isolation -e ".[dev]" "$@"
$py -m pip check
$py scripts/lock.py diff "$venv" "$LOCK" | tee "$venv/resolved.txt"
set +e
$py -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider $TESTS 2>&1 | tee "$venv/pytest.log" | tail -40
status=${PIPESTATUS[0]}
echo "row $*: pytest exit $status ($(tail -1 "$venv/pytest.log"))" | tee -a "$venv/resolved.txt"
exit "$status"
