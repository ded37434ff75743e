#!/usr/bin/env bash
# Kimi K3 GPU pass on one H200, inside BUDGET seconds (default 290): the K3 GPU tests, then the
# k3-slice decode-step benchmark for both backends with MXFP4 experts (the preset) and with BF16
# experts (the same config without quantization_config). PARTS=kernels: the MXFP4 expert
# microbenchmark (~1.5 min, not in the default set).
# Each part gets its own timeout cut to what is left of the budget; a failing or timed-out part is
# reported in $OUT/summary.txt and the next one still runs. Results land in results/ (+ $OUT).
#   PARTS="tests decode-mxfp4 decode-bf16"   which parts, in this order (also: kernels)
#   BATCHES=1,8  OUTPUT_LEN=48                       decode bench batch sizes and tokens per request
source "$(dirname "$0")/device_env.sh"
PARTS=${PARTS:-"tests decode-mxfp4 decode-bf16"}
BUDGET=${BUDGET:-290}
START=$(date +%s)
BF16_DIR=/tmp/k3-slice-bf16  # a model folder: config only, dummy weights
python3 -c "import json; from peregrine.config import PRESET_DIR as P; c = json.loads((P / 'k3-slice.json').read_text()); \
c['text_config'].pop('quantization_config'); import pathlib; d = pathlib.Path('$BF16_DIR'); d.mkdir(exist_ok=True); \
(d / 'config.json').write_text(json.dumps(c, indent=1))"
DECODE="python3 -m peregrine.cli bench decode --dummy-weights --batch-sizes ${BATCHES:-1,8} --input-len 1 \
  --output-len ${OUTPUT_LEN:-48} --prompt-sets 1 --runs 2 --backends standard,latency_specialized --results-dir results"

part() {  # name, timeout, command...
  local name=$1 t=$2 left rc t0
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 30 ]; then echo "=== $name: skipped (budget spent)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  echo "=== $name (timeout ${t}s, at $(( $(date +%s) - START ))s)"
  t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 28 "$OUT/$name.log"
  echo "$name: rc=$rc$([ $rc = 124 ] && echo ' (TIMED OUT)') in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
}

: > "$OUT/summary.txt"
for p in $PARTS; do
  case $p in
    tests) part tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --durations=8 \
             tests/test_kernels_moe_mxfp4.py tests/test_k3.py tests/test_k3_specialized.py ;;
    decode-mxfp4) part decode-mxfp4 150 $DECODE --model k3-slice ;;
    decode-bf16) part decode-bf16 150 $DECODE --model "$BF16_DIR" ;;
    kernels) part kernels 90 python3 -m peregrine.bench.kernels_moe_mxfp4 --results-dir results ;;
  esac
done
cp results/*k3-slice*decode.{json,md} results/*kernels-moe-mxfp4.json "$OUT/" 2>/dev/null
echo "=== summary (total $(( $(date +%s) - START ))s)"; cat "$OUT/summary.txt"
