#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200 (export TRITON_CACHE_AUTOTUNING=1 first: fla's first autotune is minutes on a fresh machine).
# Queued after session 11 (nothing here has run yet). First, at the head: the decode step's layer loop was refactored
# (58ec696: the same kernels in the same order by default) and gemm.launch's tiling moved into gemm.tiling (e43ac44):
#   PARTS=decode bash scripts/gpu_decode.sh   (B = 1..8 against 2.58 / 3.39 / 4.70 / 7.08 ms), then the serving run below
# - K3's bounded gate in the shared varlen fla call (VARLEN_BOUNDED_GATE, off; cut twice by fla's first autotune on a
#   fresh machine, so give it ~300 s): STEPS=tests TESTS="tests/test_prefill.py tests/test_kernels_norm.py"
#   K="k3-shared or prefill_sized" T_tests=400 bash scripts/gpu_prefill.sh
# - serving c = 8 at the current code (TPOT p50 8.93 at 5ec7707 was one run), burst and Poisson 4/s, pieces of 6 and 3:
#   STEPS=serve CONC=8 BACKENDS="latency_specialized@6 latency_specialized@3" T_serve=500 bash scripts/gpu_prefill.sh
#   (the start-up now also builds the cold-row cuDNN plans; grep WARNING in the server log for late compiles)
# - 32K cold TTFT on more machines (576.7 / 566.5 on one, 590.5 on another): STEPS=ttft LENGTHS=1024,8192,32768,131072
# - the two ~7 ms host stretches of a cold 32K step (f9ec044): profile again, now that the engine's phases are named
#   ranges (the gap listing says which one each falls in; StepInput.build's slots no longer divide per token, e58a4e5):
#   STEPS=profile CHUNKS=32768 CONTEXT=0 BUDGET=32768 STACKS=1 bash scripts/gpu_prefill.sh
# - #20, fewer launches: the residual add + RMSNorm in the in-projections' GEMM prologue (kernels/norm_gemm.py; the
#   decode step takes it with --additional-config '{"decode_fused_norm": true}', off by default) against the chain:
#   python -m pytest -m gpu tests/test_kernels_norm_gemm.py tests/test_specialized.py -k "norm_gemm or fused_norm"
#   python -m peregrine.bench.kernels_norm_gemm
#   then bench decode B = 1..8 with and without the flag in one call (turn it on if every B gains)
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
