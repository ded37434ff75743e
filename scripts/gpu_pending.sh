#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200 (export TRITON_CACHE_AUTOTUNING=1 first: fla's first autotune is minutes on a fresh machine).
# First, on by default and not yet run on a GPU (session 9 ran out of device time):
# - the GPU tests cut at 2831cec (the varlen KDA test passed at 48B widths; its K3 case, the router GEMM,
#   the one-pass norm / shared SwiGLU, the eager breakdown and the captured prefill with the norm kernels
#   did not run), then the K3 varlen case decides whether the bounded gate may share calls too:
#   STEPS=tests TESTS="tests/test_prefill.py tests/test_prefill_graphs.py tests/test_kernels_moe_prefill.py tests/test_kernels_norm.py" K="varlen or breakdown or router or prefill_sized or captured_prefill" T_tests=300 bash scripts/gpu_prefill.sh
# - serving c = 8 all at once: the varlen A/B and 3-layer pieces, and on a fresh machine whether the
#   start-up warm-up's two-row steps removed the first multi-prompt step's 84 s compile (2831cec):
#   STEPS=serve CONC=8 BACKENDS="latency_specialized@6 latency_specialized@6:novarlen latency_specialized@3" T_serve=400 bash scripts/gpu_prefill.sh
# - the same with Poisson arrivals (RATE=4) once the above is settled.
# - TPOT at c = 8 (9.38 ms against <= 9): a 2 048-token chunk beside the decodes reads nearly every expert, so a
#   larger budget per step may amortise that over more prompts at the price of longer pieces (ITL p99 32.6):
#   STEPS=serve CONC=8 BACKENDS="latency_specialized@6+3072 latency_specialized@6+4096 latency_specialized@4+4096" T_serve=400 bash scripts/gpu_prefill.sh
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
