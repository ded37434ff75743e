#!/usr/bin/env bash
# The GPU work the open issues still wait for, as one device call on the two-GPU kind (~9 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# phase 1, side by side:
#   GPU 0  GPU tests not yet passed on the H200 after their last change (lookahead same-batch test,
#          K3 with MXFP4 — one pytest per file, tracebacks kept), then the KDA microbenchmark with
#          fla's fused_recurrent_kda beside it (#4)
#   GPU 1  k3-slice decode, MXFP4 experts with the measured tiles and v2 at B = 1, and BF16 (#8);
#          the peregrine-tiny add comparison in FP32 (#7)
# phase 2 (both): TP = 2 routing-aware equivalence check, all-reduce microbenchmark, expert split (#9)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEREGRINE_COMMIT=${PEREGRINE_COMMIT:-$(cat .commit 2>/dev/null)}
exec bash scripts/gpu_lanes.sh \
  "0@285:STEPS=tests TEST_TIMEOUT=195 TESTS='tests/test_specialized.py tests/test_k3_specialized.py' bash scripts/gpu_run.sh; \
timeout 80 python3 -m peregrine.cli bench kernels --families kda --results-dir results" \
  "1@285:PARTS='decode-mxfp4 decode-bf16' BUDGET=215 bash scripts/gpu_k3.sh; \
timeout 60 python3 -m peregrine eval --task add --n 500 --device cuda --dtype fp32 --results-dir results/fp32 \
--compare '{\"decode_backend\": \"latency_specialized\"}'" \
  -- \
  "0,1:TP=2 STEPS='check allreduce moesplit' CHECK_TIMEOUT=75 ALLREDUCE_TIMEOUT=50 MOESPLIT_TIMEOUT=50 bash scripts/tp_gpu_run.sh"
