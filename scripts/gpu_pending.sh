#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - the TP teardown after CUDA graph replays (hung at 1571ff5; reordered and bounded since, not re-run):
#   the FP32 TP = 2 check with --graphs must now finish and write its JSON well inside its limit
# - k3-slice at all 6 layers, FP32, TP = 2 vs TP = 1 (its first 4 layers passed at 1571ff5)
# On the eight-GPU kind (#11): TP=8 STEPS='check decode k3' bash scripts/tp_gpu_run.sh
# On one H200 (device_env.sh sets TRITON_CACHE_AUTOTUNING=1: fla's first autotune is minutes on a fresh machine, once).
# Queued after session 13 (Poisson serving ran at 65cc9be; results/README.md "Session 13"). Mind the 8 files a call
# returns: gpu_prefill.sh's bundles carry the whole results/ tree, so write logs to $OUT and tar the rest once.
# - carry: tracked files + all of .whl exceed the 64 MiB a call carries; carry a .whl with only what the run needs
# - an idea, not in the code: the engine's step input built without blocking (c50f5ab, reverted in 386df6c because
#   it changed every step, decode included, with no GPU run behind it); it needs `bench decode`, a c = 8 serving
#   run and the 32K --sync-debug profile (1 host sync expected) against the blocking build on one machine
# - the residual-add fusions (886bddd) A/B on one machine, still not run (and PEREGRINE_KDA_GATED_NORM=0 likewise):
#   for v in 1 0 1; do PEREGRINE_FUSED_RESIDUAL=$v OUT=$OUT/r$v STEPS=ttft LENGTHS=32768 RUNS=5 T_ttft=300 bash scripts/gpu_prefill.sh; done
#   (the first run pays fla's autotune on a fresh machine: compare the 2nd and 3rd)
# - serving c = 8, 40 requests at once, at the head (last at 886bddd): STEPS=serve CONC=8 BACKENDS="latency_specialized@6"
# - #20 after session 16 (bench decode at 8605bf6: 2.341 / 3.212 / 4.524 / 6.860 ms): the MLA prologue's FP8-scale test
#   relaxed to an ulp (7384258), not re-run on the GPU: python3 -m pytest -q -m gpu tests/test_kernels_mla_prologue.py;
#   the router re-tune with one-warp candidates timed out at 200 s (give kernels_moe --tune ~300 s); W_UV folded into
#   mla_combine; the KDA decode (8 us a layer); the in-projection GEMM (80 % of copy)
# - the whole turn: measured at c55ca27 (session 18 call 4); repeat after any change to prefill or scheduling:
#   STEPS="ttft serve" LENGTHS=1024,8192,32768 RUNS=3 CONC=8 RATE=4 BACKENDS="latency_specialized@6" bash scripts/gpu_prefill.sh
#   (carry .commit and a .whl without the test-only wheels: transformers & co. are not needed, ~7 MB is)
# - #20 after session 18: the step timeline with distinct tokens per batch row (TIMELINE=1 TIMELINE_ARGS=--distinct-tokens;
#   until now every row carried one token, so
#   its B > 1 routing is not a real batch's) before choosing the next MoE work at B = 2..8; the o_proj (2304 x 4096)
#   at ~50 % of copy for M >= 2 whatever the tile (wide, deep and resident sweeps all ~8.9 us): first its tiling's
#   read ceiling, MICRO="kernels_gemm --shapes oproj --ms 1,2,4,8 --pdl --stream"; the KDA decode's
#   conv-state reads hoisted (off, same bits, CPU-tested) and the RMSNorms / router top-k triggering their successor
#   before their wait (off; the GEMM after a norm and the experts' shared slot then start one kernel earlier):
#   AB="base PEREGRINE_KDA_HOIST=1 PEREGRINE_EARLY_TRIGGER=norm PEREGRINE_EARLY_TRIGGER=topk PEREGRINE_EARLY_TRIGGER=norm+topk"
#   bash scripts/gpu_decode_ab.sh (an AB variant's commas separate envs, hence "+")
# - K3's bounded gate in the shared varlen fla call (VARLEN_BOUNDED_GATE, off; cut three times by fla's autotune
#   of K3's shapes on a fresh machine, so give it ~300 s): python3 -m pytest -v -m gpu tests/test_prefill.py -k "k3-shared or k3-per-row"
# - #20's MXFP4 experts against OpenAI's triton_kernels MXFP4 MoE on k3-slice shapes: not started
# - #41 (session 22, nothing of it has run on a GPU): the sampler kernels' tests in BF16 and the specialized path's
#   sampled / logprobs graphs, the microbenchmark (sort-free sample vs the old sorted sampler, % of copy), then the
#   sampled step beside the greedy one (targets: within 3 % at B = 1, 2, 4, 8; with --logprobs 5 within 5 %), and
#   serving at c = 8 greedy vs temperature 0.6 (TPOT p50 within 5 %); one H200, ~15 min:
#   python3 -m pytest -q -m gpu tests/test_kernels_sampling.py tests/test_lookahead.py tests/test_outputs.py \
#     tests/test_specialized.py -k "sampl or logprob or penalt or min_tokens or lookahead or graph" 2>&1 | tee $OUT/pytest-sampling.log
#   python3 -m peregrine.bench.kernels_sampling 2>&1 | tee $OUT/kernels-sampling.log
#   for lp in "" "--logprobs 5"; do python3 -m peregrine bench decode --model kimi-linear-48b-a3b --dummy-weights \
#     --backends latency_specialized --batch-sizes 1,2,4,8 --prompt-sets 1 --runs 2 --output-len 256 \
#     --temperature 0.6 --top-p 0.95 $lp 2>&1 | tee -a $OUT/decode-sampled.log; done
#   serving, greedy then sampled: for s in "" "--temperature 0.6 --top-p 0.95"; do SAMPLING="$s" CONC=8 NP=40 \
#     BACKENDS=latency_specialized bash scripts/gpu_serve.sh; done   (TPOT p50 within 5 %)
#   kernels_sampling times the candidate search (default) against the whole-row bisection (bisect_ms); for the
#   decode bench A/B: PEREGRINE_SAMPLE_SEARCH=bisect. How often candidates settle a row on real text (CUT = 12,
#   CAND_CAP = 128 a chunk) is not known: dummy weights' logits are not real text's
# - #47 (session 22): the 10-minute soak of the 48B at c = 8 with the mixed traffic, host RSS and GPU memory every 30 s,
#   with the trims and (AB=1) without them first (~25 min with both; ~12 alone):
#   run (carry .commit and .whl):  DURATION=600 CONC=8 bash scripts/gpu_soak.sh    (target: RSS growth <= 100 MB, no errors)
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
