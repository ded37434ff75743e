#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200 (export TRITON_CACHE_AUTOTUNING=1 first: fla's first autotune is ~2 min on a fresh machine).
# First, since they are on by default and have never run on a GPU: the glue kernels (below) and the
# prefill-graph / KDA-tail GPU tests, in one call: STEPS="glue tests pmoe" with the K filter below; and since
# the decode graphs' capture moved into standard.capture (8476a21, mechanical, not run on a GPU):
#   STEPS=tests TESTS="tests/test_specialized.py tests/test_prefill_graphs.py" T_tests=240 bash scripts/gpu_prefill.sh
# - the GPU tests session 8 did not reach at fbf257f (the KDA tail kernel after fla, prefill graphs):
#   STEPS=tests TESTS="tests/test_prefill.py tests/test_prefill_graphs.py" K="gpu_prefill_kernels or captured_prefill" T_tests=240 bash scripts/gpu_prefill.sh
# - 32K cold and turn 2 with prefill graphs (the 8192-token bucket; 32K last measured before them, bc02d61):
#   STEPS=ttft LENGTHS=32768 RUNS=3 T_ttft=240 bash scripts/gpu_prefill.sh
# - serving at c = 8 again: pieces now launch before the decode's tokens are read (fc0e719's engine change),
#   with Poisson arrivals too (never run on the GPU), and c = 4 with graphs:
#   STEPS=serve CONC=8 RATE=4 BACKENDS="latency_specialized@6 latency_specialized@3" T_serve=300 bash scripts/gpu_prefill.sh
# - the MoE prefill glue kernels (kernels/moe_prefill.py, on by default for prefill-sized BF16 steps since
#   19dc936; never run on a GPU): their GPU tests, their microbenchmark against the
#   torch forms, then 8K / 32K cold TTFT with the per-layer-type breakdown (MoE was 525.8 ms of 1 037 at 32K):
#   STEPS="glue ttft" LENGTHS=8192,32768 RUNS=3 T_glue=120 T_ttft=300 bash scripts/gpu_prefill.sh
# - #20: the persistent MoE block's second version (narrow dependencies, wider up tiles) against the chain:
#   STEPS=pmoe T_pmoe=120 bash scripts/gpu_prefill.sh
# - whether the start-up capture's Tb - 1 lengths removed the ~2.3 s first-use stalls of a fresh machine
#   (fbf257f's first server: TTFT p90 2 330 ms): the serve step on a fresh machine, TTFT p90/p99
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
