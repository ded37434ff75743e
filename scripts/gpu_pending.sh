#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200, for #18 and #19 (~9 min): the GPU pass of the decode-path tests the session-6 changes
# touch (test_specialized.py was cut by time limits; the transformers conformance test never ran there),
# then the TTFT and serving runs with the 3-stage MLA prefill tile (session 6 measured the 2-stage one),
# serving with Poisson arrivals:
#   STEPS="tests ttft serve" TESTS="tests/test_specialized.py tests/test_hf_conformance.py tests/test_prefill.py" \
#     T_tests=300 T_ttft=150 T_serve=150 RATE=4 LENGTHS=1024,8192,32768 bash scripts/gpu_prefill.sh
# and the decode step itself: peregrine bench decode --model kimi-linear-48b-a3b --dummy-weights
#     --batch-sizes 1,8 --prompt-sets 1 --runs 1 --output-len 128
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
