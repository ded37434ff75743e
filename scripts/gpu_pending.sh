#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200 (~6 min): the fla prefill GPU tests since 473fbfc changed how fla rows are normed and
# stored (each row's gated RMSNorm by fla, the layer's output buffer in the model dtype): twice cut by a
# 100-150 s limit inside fla's first autotune, so give them ~300 s:
#   STEPS=tests TESTS=tests/test_prefill.py K="kda_prefill_paths or gpu_prefill_kernels" T_tests=330 bash scripts/gpu_prefill.sh
# then serving at c = 8 with smaller pieces (904e73a's /metrics: 142 piece steps averaged 49 ms, which
# sets its ITL p99 of 68.5 ms; 3 layers should halve a piece), and with Poisson arrivals (never run on the GPU):
#   STEPS=serve CONC=8 BACKENDS="latency_specialized@3 latency_specialized@6" T_serve=250 bash scripts/gpu_prefill.sh
#   STEPS=serve CONC=8 RATE=4 BACKENDS="latency_specialized@0 latency_specialized" T_serve=250 bash scripts/gpu_prefill.sh
# #20's first measurement (~1 min): the persistent MoE block against the chain, same ops, B = 1, 2, 4, 8
# (python -m peregrine.bench.persistent_moe), and its interpreter tests compiled for real
# (pytest tests/test_kernels_persistent_moe.py); on the GPU a bad table must also end, not hang.
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
