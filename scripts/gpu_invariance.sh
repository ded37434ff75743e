#!/usr/bin/env bash
# #69 on one H100 or H200, ~8 min: --batch-invariant's GPU tests (the tiny preset's shapes and the 48B's widths,
# bitwise), then its cost on the same machine: the decode step at B = 1, 2, 4, 8 and TTFT at 8K, default vs the mode.
# An H100 runs the 48B with MXFP4 experts (as gpu_check.sh). JSON under results/invariance/, logs in $OUT.
#   run (carry .commit):  bash scripts/gpu_invariance.sh      PARTS (default "tests decode ttft")
source "$(dirname "$0")/device_env.sh"
R=results/invariance; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "commit ${PEREGRINE_COMMIT:-unknown}" | tee -a "$OUT/gpu.txt"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
M=kimi-linear-48b-a3b
if [ "${mib:-0}" -lt 100000 ]; then
  M=/tmp/kimi-linear-48b-a3b-mxfp4; mkdir -p $M
  python3 -c "import json; d = json.load(open('peregrine/presets/kimi-linear-48b-a3b.json'))
d['quantization_config'] = {'format': 'mxfp4-pack-quantized', 'quant_method': 'compressed-tensors'}
json.dump(d, open('$M/config.json', 'w'), indent=1)"
fi
rc=0
for p in ${PARTS:-tests decode ttft}; do
  echo "=== $p ($(date -u +%T))"
  case $p in
    tests)
      timeout "${T_tests:-240}" python3 -m pytest -m gpu -v --tb=short -p no:cacheprovider tests/test_batch_invariance.py \
        > "$OUT/invariance-tests.log" 2>&1 || rc=1
      grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/invariance-tests.log" | tail -15 ;;
    decode)
      for inv in 0 1; do
        VLLM_BATCH_INVARIANT=$inv timeout "${T_decode:-150}" python3 -m peregrine bench decode --model $M --dummy-weights \
          --backends latency_specialized --batch-sizes 1,2,4,8 --input-len 1 --output-len 128 --prompt-sets 1 --runs 2 \
          --results-dir $R/invariant-$inv 2>&1 | tee "$OUT/decode-invariant-$inv.log" | grep -E "B=|copy bandwidth|rror" \
          | grep -v captur || rc=1
      done ;;
    ttft)
      for inv in 0 1; do
        VLLM_BATCH_INVARIANT=$inv timeout "${T_ttft:-120}" python3 -m peregrine bench ttft --model $M --dummy-weights \
          --lengths 8192 --runs 2 --breakdown-len 0 --results-dir $R/invariant-$inv 2>&1 \
          | tee "$OUT/ttft-invariant-$inv.log" | grep -E "8192|TTFT|ttft|rror" | tail -4 || rc=1
      done ;;
    *) echo "unknown part $p (tests decode ttft)"; rc=1 ;;
  esac
done
tar czf "$OUT/invariance-results.tgz" $R
exit $rc
