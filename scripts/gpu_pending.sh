#!/usr/bin/env bash
# The GPU work the open issues still wait for, as one device call on the two-GPU kind (~9 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# phase 1, side by side:
#   GPU 0  the K3 path-equivalence and MoE / MXFP4 kernel tests (K3 MXFP4 judged against an FP32 run where the BF16 paths
#          drift apart), then the expert-split benchmark timed in CUDA graphs (#8, #9)
#   GPU 1  k3-slice decode at TP = 1, MXFP4 experts, B = 1, 2, 4, 8 (#8, #9's TP = 1 side)
# phase 2 (both): TP = 2 decode of k3-slice (K3 layers now on the specialized path under TP), then
#          kimi-linear-48b-a3b with the router / MLA latent sliced (#9)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEREGRINE_COMMIT=${PEREGRINE_COMMIT:-$(cat .commit 2>/dev/null)}
exec bash scripts/gpu_lanes.sh \
  "0@235:STEPS=tests TEST_TIMEOUT=185 TESTS='tests/test_k3_specialized.py tests/test_kernels_moe_mxfp4.py tests/test_kernels_moe.py' bash scripts/gpu_run.sh; \
timeout 45 python3 -m peregrine.bench.moe_split --model kimi-linear-48b-a3b --tp 2 --results-dir results" \
  "1@235:PARTS=decode-mxfp4 BATCHES=1,2,4,8 BUDGET=230 bash scripts/gpu_k3.sh" \
  -- \
  "0,1:TP=2 STEPS='k3 decode' DECODE_TP1=0 DECODE_VARIANTS=slice OUTPUT_LEN=32 DECODE_TIMEOUT=150 bash scripts/tp_gpu_run.sh"
