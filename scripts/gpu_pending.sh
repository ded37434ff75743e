#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200, for #18 (prefill, ~8 min): the TTFT and serving runs with the 3-stage MLA prefill tile
# (session 6 measured the 2-stage one), serving with Poisson arrivals, and test_specialized.py on the
# GPU (cut by time limits in session 6):
#   STEPS="tests ttft serve" TESTS=tests/test_specialized.py T_tests=240 T_ttft=200 T_serve=200 RATE=4 \
#     bash scripts/gpu_prefill.sh
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
