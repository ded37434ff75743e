#!/usr/bin/env bash
# The GPU work the open issues still wait for, as one device call on the four-GPU kind (~9 min):
#   run (kind nvidia-h200-x4, carry .commit and .whl):  bash scripts/gpu_pending.sh
# phase 1, side by side:
#   GPU 0    GPU tests not yet passed on the H200 after their last change (lookahead same-batch test,
#            K3 with MXFP4 — one pytest per file, tracebacks kept), then the KDA microbenchmark
#            with fla's fused_recurrent_kda beside it (#4)
#   GPU 1    k3-slice decode, MXFP4 experts with the measured tiles and v2 at B = 1, and BF16 (#8);
#            the peregrine-tiny add comparison in FP32 (#7)
#   GPUs 2-3 TP = 2: routing-aware equivalence check, all-reduce microbenchmark, the expert-split
#            benchmark, decode with the router / MLA latent sliced (#9)
# phase 2 (all four): TP = 4 check and k3-slice decode (#11)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEREGRINE_COMMIT=${PEREGRINE_COMMIT:-$(cat .commit 2>/dev/null)}
exec bash scripts/gpu_lanes.sh \
  "0@300:STEPS=tests TEST_TIMEOUT=200 TESTS='tests/test_specialized.py tests/test_k3_specialized.py' bash scripts/gpu_run.sh; \
timeout 90 python3 -m peregrine.cli bench kernels --families kda --results-dir results" \
  "1@300:PARTS='decode-mxfp4 decode-bf16' BUDGET=220 bash scripts/gpu_k3.sh; \
timeout 60 python3 -m peregrine eval --task add --n 500 --device cuda --dtype fp32 --results-dir results/fp32 \
--compare '{\"decode_backend\": \"latency_specialized\"}'" \
  "2,3@300:TP=2 STEPS='check allreduce moesplit decode' DECODE_TP1=0 DECODE_VARIANTS=slice CHECK_TIMEOUT=80 DECODE_TIMEOUT=100 \
bash scripts/tp_gpu_run.sh" \
  -- \
  "0,1,2,3:TP=4 STEPS='check k3' DECODE_TP1=0 CHECK_TIMEOUT=70 DECODE_TIMEOUT=110 bash scripts/tp_gpu_run.sh"
