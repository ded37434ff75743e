#!/usr/bin/env bash
# docs/correctness.md §3 on the trained peregrine-tiny: accuracy per task, then side-by-side greedy answers
# standard vs latency_specialized (must be identical) and BF16 vs FP8 cache (within 1 point).
# N problems per task (default 500); NCMP for the specialized comparison (the CPU runs it through
# the Triton interpreter, so use fewer there). Extra args go to every `peregrine eval` (e.g. --device).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${N:-500}; NCMP=${NCMP:-$N}; TASKS=${TASKS:-"add copy recall"}; STAGES=${STAGES:-"acc spec fp8"}
rc=0
for st in $STAGES; do for t in $TASKS; do
  case $st in
    acc)  $PY -m peregrine eval --task "$t" --n "$N" "$@" || rc=1 ;;
    spec) $PY -m peregrine eval --task "$t" --n "$NCMP" --compare '{"decode_backend": "latency_specialized"}' "$@" || rc=1 ;;
    fp8)  $PY -m peregrine eval --task "$t" --n "$N" --compare '{"kv_cache_dtype": "fp8"}' --tolerance-points 1 "$@" || rc=1 ;;
  esac
done; done
exit $rc
