#!/usr/bin/env bash
# Issue #5's decode-step benchmark on one H200: kimi-linear-48b-a3b (dummy weights), both backends,
# B = 1, 2, 4, 8 at input length 1 (the engine's lookahead on, and one run per B with it off), then
# the 8K-context case (docs/benchmarks.md §1; results/ctx8k/), then the per-kernel profile at B = 1 and 8.
#   PARTS="decode ctx8k profile"  DECODE_ARGS="--prompt-sets 2 --runs 1 --output-len 256"
#   CTX_ARGS="--batch-sizes 1,8 --output-len 64 --prompt-sets 1 --runs 1"
source "$(dirname "$0")/device_env.sh"
BENCH="python3 -m peregrine.cli bench decode --model kimi-linear-48b-a3b --dummy-weights --backends standard,latency_specialized"
for p in ${PARTS:-decode ctx8k profile}; do
  echo "=== $p ($(date -u +%T))"
  case $p in
    decode)
      timeout ${DECODE_TIMEOUT:-170} $BENCH --batch-sizes 1,2,4,8 --input-len 1 ${DECODE_ARGS:---prompt-sets 2 --runs 1 --output-len 256} \
        --results-dir results 2>&1 | tee "$OUT/decode.log" | grep -v captur | tail -16 ;;
    ctx8k)
      timeout ${CTX_TIMEOUT:-120} $BENCH --input-len 8192 ${CTX_ARGS:---batch-sizes 1,8 --output-len 64 --prompt-sets 1 --runs 1} \
        --results-dir results/ctx8k 2>&1 | tee "$OUT/decode-8k.log" | grep -v captur | tail -10 ;;
    profile)
      timeout ${PROFILE_TIMEOUT:-100} python3 -m peregrine.bench.profile_step --model kimi-linear-48b-a3b --dummy-weights --batch-sizes 1,8 \
        --backends latency_specialized --results-dir results 2>&1 | tee "$OUT/profile.log" | grep -v captur | tail -40 ;;
    mxfp4)  # MXFP4 experts (v3) vs BF16 (k3-slice shapes)
      timeout ${MXFP4_TIMEOUT:-150} python3 -m peregrine.bench.kernels_moe_mxfp4 --results-dir results 2>&1 | tee "$OUT/mxfp4.log" | tail -16 ;;
    *) echo "unknown part $p (decode ctx8k profile mxfp4)" ;;
  esac
done
