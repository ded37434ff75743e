#!/usr/bin/env bash
# The GPU work the open issues still wait for, as one device call on the two-GPU kind (~8 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# phase 1, side by side:
#   GPU 0  k3-slice decode at TP = 1, MXFP4 experts, specialized path, B = 1, 2, 4, 8 (#9's TP = 1 side)
#   GPU 1  the MoE kernel tests, the ahead-of-time compile check last (cut by lane limits twice)
# phase 2 (both): k3-slice TP = 2 decode, both paths, with decode lookahead under TP (#9)
# On the four- or eight-GPU kind, add a phase: TP=4 (or 8) STEPS='check decode k3' bash scripts/tp_gpu_run.sh (#11).
set -uo pipefail
cd "$(dirname "$0")/.."
export PEREGRINE_COMMIT=${PEREGRINE_COMMIT:-$(cat .commit 2>/dev/null)}
K3="python3 -m peregrine.cli bench decode --dummy-weights --model k3-slice --batch-sizes 1,2,4,8 --input-len 1 --output-len 32 --prompt-sets 1 --runs 1"
exec bash scripts/gpu_lanes.sh \
  "0@240:timeout 230 $K3 --backends latency_specialized --results-dir results/k3-tp1 2>&1 | grep -v captur | tail -14" \
  "1@240:STEPS=tests TEST_TIMEOUT=230 TESTS='tests/test_kernels_moe.py' bash scripts/gpu_run.sh" \
  -- \
  "0,1:timeout 280 $K3 --tensor-parallel-size 2 --backends standard,latency_specialized --results-dir results/k3-tp2-lookahead 2>&1 | grep -v captur | tail -16"
