#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200 (export TRITON_CACHE_AUTOTUNING=1 first: fla's first autotune is minutes on a fresh machine).
# Queued after session 10 (5ec7707 and later; nothing here has run yet):
# - K3's bounded gate in the shared varlen fla call (VARLEN_BOUNDED_GATE, off): its case decides turning it on,
#   and the one-pass norm / shared SwiGLU test session 9 left:
#   STEPS=tests TESTS="tests/test_prefill.py tests/test_kernels_norm.py" K="k3-shared or prefill_sized" T_tests=400 bash scripts/gpu_prefill.sh
# - serving c = 8 again (TPOT p50 8.93 was one run): all at once and Poisson 4/s, pieces of 6 and 3, the varlen A/B;
#   and the fresh machine's first 8-prompt step (~1.7 s at 5ec7707, ~0.17 s warm): gpu_serve.sh now sets
#   PEREGRINE_LOG_COMPILES=1, so the server log names every Triton kernel compiled after the warm-up (grep WARNING):
#   STEPS=serve CONC=8 BACKENDS="latency_specialized@6 latency_specialized@6:novarlen latency_specialized@3" T_serve=500 bash scripts/gpu_prefill.sh
#   STEPS=serve CONC=8 RATE=4 BACKENDS="latency_specialized@6" T_serve=300 bash scripts/gpu_prefill.sh
# - 32K cold TTFT (622.3 against <= 580): the kda_conv kernel is at 46 % of the copy bandwidth; every BLOCK_T x warps
#   candidate was slower; its heads-first grid (CH_MAJOR) is untimed: python -m peregrine.bench.kernels_kda_conv
#   (turn CH_MAJOR on if it wins); the up GEMM with its row gather and SwiGLU fused (kernels/moe_gate_up.py,
#   FUSED_GATE_UP off, untimed): its GPU tests, then bench moe_grouped times it against the unfused chain with
#   five tile candidates (turn it on, with the winning tile as DEFAULT, where it wins):
#   STEPS="tests moegrouped" TESTS=tests/test_kernels_moe_gate_up.py T_tests=200 bash scripts/gpu_prefill.sh
#   then the MLA tile. Re-run STEPS=ttft LENGTHS=1024,8192,32768,131072 after each.
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
