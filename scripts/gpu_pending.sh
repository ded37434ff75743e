#!/usr/bin/env bash
# The GPU work still waiting, as one device call on the two-GPU kind (~3 min):
#   run (kind nvidia-h200-x2, carry .commit and .whl):  bash scripts/gpu_pending.sh
# - #65 after session 32 (CPU-built, none of it on a GPU yet; the head check at a3e91d3 ran first: results/README.md
#   "Session 32"). In this order, one H100 (the 48B with MXFP4 experts) unless said, carry .commit (and a .whl with
#   xgrammar + apache-tvm-ffi for the image that lacks them):
#   1. the MXFP4 experts' grouped kernel (kernels/moe_mxfp4_prefill.py), ~3 min: its GPU tests, then its GB/s and
#      TFLOP/s against BF16 grouped_mm and the old dequantize loop at 1K / 8K / 32K tokens:
#        python3 -m pytest -m gpu -q tests/test_kernels_moe_mxfp4_prefill.py
#        python3 -m peregrine.bench.kernels_moe_mxfp4_prefill
#   2. the agent turn over HTTP, at most 9 min, against the issue's baseline (plain TTFT p50 2.84 s, TPOT p50 61.3 ms,
#      ITL p99 328 ms; suffix 7.42 s / 127 ms / 2.08 s; hits 62 % / 18 %): prefix reuse through forks and speculation,
#      pieces under speculation and sized by time (12 ms), MXFP4 prefill in graphs, lookahead where speculation is
#      quiet; its JSON now has each level's hits against a perfect cache's and P90 interactivity:
#        TURNS=4 CHARS=40000 bash scripts/gpu_agent_serve.sh
#      if the grouped kernel misbehaves, the same with PEREGRINE_MXFP4_GROUPED=0 (the loop) for the A/B
#   3. MXFP4 prefill against BF16 on one H200 (both 48Bs fit), TTFT 1K / 8K / 32K (target >= 0.7x BF16's tokens/s):
#        STEPS=ttft LENGTHS=1024,8192,32768 RUNS=3 bash scripts/gpu_prefill.sh   (then MODEL=<the mxfp4 config>)
#   4. the head check's spec part for a step with speculation on that verifies nothing (now launched ahead): synthetic
#      1.5 at B = 2, 4, 8 and n-gram with nothing to propose, against plain (target <= 2 % over plain):
#        PARTS=spec bash scripts/gpu_check.sh
#   5. #66's GPU tests (the decode graphs' constrained and deferred-draw variants), ~2 min:
#        python3 -m pytest -m gpu -q tests/test_guided.py tests/test_tools.py
# - #69 batch invariance (sessions 33-34, CPU only): --batch-invariant pins the fused decode kernels' plans to static
#   sizes (gemm invariant_config, MLA invariant_splits) and, since session 34, runs prefill through fixed forms
#   (gemm prefill_invariant_config for every projection and expert, the flash MLA kernel without KV splits, fla per
#   row, prompts split at multiples of 64, prefix reuse of prompt blocks only). On one H100, ~6 min:
#   all three in one call: bash scripts/gpu_invariance.sh (commit results/invariance/ and its logs)
#   1. the tests, compiled: the tiny preset's shapes and the 48B's widths (3 layers: greedy and sampled probes
#      alone, beside others, after a prefix hit, in chunks and in pieces, bitwise):
#        python3 -m pytest -m gpu -q tests/test_batch_invariance.py
#   2. its cost, the step against the default at B = 1, 2, 4, 8 (target <= 1.15x), same run
#   3. TTFT at 8K with and without it (the fixed-tile prefill GEMMs and the per-expert loop are its cost)
# - #57 after session 31 (its head check ran on an H100 at 1b89fb0: results/2026-12-06-session31, results/README.md
#   "Session 31": sampled 1.065-1.131x greedy, all of it the descent over dummy weights' flat rows; 16 pivots a
#   level measured 1.031 / 1.034x at B = 1 / 8 in the step and is the default since 5f5dbaf; synthetic 3.78 met
#   at B = 1 and 8; 1.5 at B = 8 0.84x, the chooser's stale plain excess, fixed in 025641a, not re-measured).
#   Since: logprobs in the step by two Triton launches (kernels/logprobs.py, in place of torch's logsumexp + topk,
#   which cost ~0.11 ms at B = 1); the candidates' searches skipped for rows whose chunks overflowed (flat rows:
#   30 / 37 us of candidate passes at B = 1 / 8 beyond the descent); neither run on a GPU.
#   In this order, one H100 or H200 each (carry .commit):
#   1. the head check, at most 9 min (now with 16 pivots, the logprobs kernels and the chooser's fix, and a part
#      timing the sampler's and logprobs' launches; commit results/check/ and the table it prints last):
#        bash scripts/gpu_check.sh
#      then the spec targets at B = 2 and 4 (1.5 / 1.3x at 3.78), ~3 min:
#        python3 -m peregrine bench spec --model <the check's model> --dummy-weights --batch-sizes 2,4 --k 7 \
#          --input-len 256 --output-len 128 --no-oracle --acceptance-lengths 1.5,3.78 --widths auto \
#          --temperature 0.6 --top-p 0.95 --results-dir results
#   2. the agent turn over HTTP, at most 9 min (c = 8 agent sessions, replies forced, suffix server against plain,
#      greedy and sampled, plus plain unforced; targets: TPOT p50 <= 0.8x, TTFT p50 within 5 %, ITL p99 <= 25 ms, 0 errors):
#        bash scripts/gpu_agent_serve.sh
#   3. the agent turn in-process, sampled beside greedy, on an H200 (the BF16 48B), ~9 min each:
#        PARTS=replay bash scripts/gpu_drafters.sh
#        REPLAY_ARGS="--replay-temperature 0.6 --replay-top-p 0.95" PARTS=replay bash scripts/gpu_drafters.sh
#   4. the drafter inside the verify graph, its tiny eval (its GPU test passed in session 31):
#        PARTS="tests tiny" METHODS=dspark bash scripts/gpu_drafters.sh
#   5. the soak with warm-up under load (~13 min: start it detached, collect it in a second call; by request
#      count or duration: DURATION keeps the old behaviour): (OUT=/tmp/soak DURATION=600 CONC=8 setsid nohup bash
#      scripts/gpu_soak.sh > /tmp/soak.log 2>&1 < /dev/null &)
#   6. the GPU tests the head check's time cut (from tests/test_kernels_mla_prefill.py on), ~4 min:
#        python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_mla_prefill.py tests/test_kernels_moe*.py \
#          tests/test_kernels_norm.py tests/test_kernels_sampling.py tests/test_specialized.py tests/test_k3_specialized.py \
#          tests/test_spec_specialized.py tests/test_pdl.py
#   Then: README's sampled and speculative rows from these runs (date, commit, GPU).
# - #58 / #59 after session 31 (request isolation and validation in the engine and server, KV events and readiness:
#   CPU-tested; sampled + greedy decode and spec ran at 1b89fb0 with them, the whole turn did not): one H200, ~9 min,
#   carry .commit: the turn against session 18's record (c55ca27), events off as served by default, then serving
#   sampled and with KV events published (the prefix cache announces blocks; the fleet extra's pyzmq and msgpack
#   wheels in a carried .whl if the image lacks them):
#     STEPS="ttft serve" LENGTHS=1024,8192,32768 RUNS=3 CONC=8 RATE=4 BACKENDS="latency_specialized@6" bash scripts/gpu_prefill.sh
#     SAMPLING="--temperature 0.6 --top-p 0.95" SERVE_FLAGS="--kv-events-config {\"enable_kv_cache_events\":true}" \
#       STEPS=serve CONC=8 RATE=4 BACKENDS="latency_specialized@6" bash scripts/gpu_prefill.sh
# - #60 after session 31 (the persistent layer's first run since its rewrite, H100, 3c409e8: dense chain B = 1 and
#   MoE block B = 1 passed, the whole KDA + MoE layer B = 1 failed, its row truncated; no hang, 6 s): build .cute
#   (bash scripts/build_cute_gpu.sh), carry .commit and .cute, ~2 min; the test now prints the failing row whole:
#     timeout 100 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_cute_gpu.py
#   then #46's entry below (kernels_cute, gpu_persistent_layer.sh) once it passes.
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
#   read ceiling, MICRO="kernels_gemm --shapes oproj --ms 1,2,4,8 --pdl --stream"
# - K3's bounded gate in the shared varlen fla call (VARLEN_BOUNDED_GATE, off; cut three times by fla's autotune
#   of K3's shapes on a fresh machine, so give it ~300 s): python3 -m pytest -v -m gpu tests/test_prefill.py -k "k3-shared or k3-per-row"
# - #20's MXFP4 experts against OpenAI's triton_kernels MXFP4 MoE on k3-slice shapes: not started
# - #41 after session 23 (results/2026-12-05-session23: at 4ce4980 the sampled step was greedy + 1.4 ms at every B,
#   the candidates never settling dummy weights' flat rows and the one-program bisection costing 1.3 ms; the
#   descent over the row's chunks replaced it in 4781ebb): one H200, ~12 min, carry .commit and .whl:
#   LOGPROBS="0 5" T_decode=140 PARTS="decode kernels tests serve" bash scripts/gpu_sampling.sh
#   (targets: sampled within 3 % of greedy at B = 1, 2, 4, 8, with --logprobs 5 within 5 %, c = 8 TPOT p50 within 5 %;
#   kernels_sampling times the default against the descent alone at 64 / 32 / 128 pivots and the bisection, on
#   flat and peaked logits: pick the default from it; tests now include the standard runner's device draw)
#   and the default backend's sampled serving (the standard runner now draws in its graphs too):
#   SAMPLING="--temperature 0.6 --top-p 0.95" CONC=8 NP=40 BACKENDS=standard bash scripts/gpu_serve.sh
# - #47 after session 23 (its 600 s soak at 4ce4980: RSS +114 MB in the first 30 s of load, then +11 MB over 570 s;
#   2 164 of 3 301 answers unlike the idle server's, by BF16 per-B rounding): the soak again with a 60 s warm-up
#   under load and docs/correctness.md's top-5 rule (~13 min, so start it detached and collect it in a second call):
#   (OUT=/tmp/soak DURATION=600 CONC=8 setsid nohup bash scripts/gpu_soak.sh > /tmp/soak.log 2>&1 < /dev/null &)
# - #42 (session 23: items 1 and 3 built and CPU-tested, nothing of it on a GPU): the synthetic-acceptance protocol
#   with the width chooser against full width, one H200 (~10 min; the 48B's verify graphs for k = 7 are B 1..8 x T 2..8):
#   python3 -m peregrine bench spec --model kimi-linear-48b-a3b --dummy-weights --batch-sizes 1,2,4,8 --k 7 \
#     --input-len 256 --output-len 128 --no-oracle --acceptance-lengths 2.33,3,3.78,4.73,6 --widths auto,full
#   then --k 3 --acceptance-lengths 2.33,3,3.78, and --input-len 32768 --batch-sizes 1 --acceptance-lengths 3.78
#   (targets at 3.78, k = 7: >= 1.7 / 1.5 / 1.3 / 1.15 x plain at B = 1 / 2 / 4 / 8; 6.0: >= 2.2 x at B = 1; never < 1.0 x)
#   Since 85ced9d the chooser's table is timed with a different token in every row (session 29: with one token in
#   every row the 48B's verify steps ran ~3.2 ms over it, the MoE's expert union); the log prints the table
#   #42 item 2, its first piece: the skinny GEMM's wide tile (17..64 verify rows in one M tile, weights streamed once),
#   off by default: python3 -m peregrine.bench.kernels_gemm --shapes decode48b --ms 16,24,32,40,48,56,64 (skinny vs
#   cuBLAS per shape, same run), then bench spec above with PEREGRINE_VERIFY_GEMM=triton against without; make it the
#   default (and plan "torch" entries where cuBLAS wins) only on that evidence
# - session 24 (no device lent): #41's descent reworked in 8391a25 (its slices sized by B: 160 programs at B = 1, not
#   40; the pivot counts in a register tile reduced once; top-k's 6 levels not launched unless a row uses top-k, a
#   "topk" graph variant). The #41 run above measures it as is; kernels_sampling now also times the slices fixed at
#   1024 / 2048 / 4096 (radix_block*) and top-p with top-k's levels launched (radix_topk_levels): if a fixed slice
#   beats the by-B default, repeat decode with PEREGRINE_SAMPLE_DESCENT_BLOCK=<it> in the same call
# - #42 item 2, MLA (d83fba9): a verify step's T rows share the sequence's table and length in the kernel (default,
#   no expand in the graph) and, opt-in, two rows a program (M = 64, each latent tile read once for both; ptxas
#   spills ~200 B a thread). Same-run A/B against the old expanded rows and the plain decode, ~3 min:
#   python3 -m peregrine.bench.kernels_mla --verify --quick
#   then bench spec (above) with PEREGRINE_MLA_VERIFY_ROWS=2 and =0 against the default (1) at ISL 32768, B = 1
#   (make 2 the default only where it wins; 0 is the pre-#42 layout)
# - #43 after session 29 (results/2026-12-05-session29: the 48B BF16 replay ran on an H200 at 260778b, suffix
#   1.79x plain, every turn 1.08-2.25x; the drafter step, tests and tiny eval on an H100). Left, one H200, ~5 min:
#   PARTS="replay" bash scripts/gpu_drafters.sh   after 6da3fcf (verify GEMMs at untuned row counts, 3 and 5-7 at
#   B = 1, take the next tuned M's plan entry instead of the heuristic: the cost table's T = 3 read 5.10 ms against
#   T = 4's 3.98 at 260778b) and 85ced9d (the table timed with a different token in every row: verify steps ran
#   ~3.1-3.3 ms over the table, plain ones 0.17, the MoE's expert union): the table should now rise with T and read
#   about what verify steps take (each run's excess_ms_per_step, a5cd2ed: 3.07 / 3.26 at 260778b), and the chooser pick
#   narrower widths where they pay; and the same sampled beside it (temperature 0.6, top_p 0.95; the recorded tokens still
#   win): REPLAY_ARGS="--replay-temperature 0.6 --replay-top-p 0.95" PARTS=replay bash scripts/gpu_drafters.sh.
#   Then the kernels' own checks: python3 -m pytest -q -m gpu
#   tests/test_kernels_gemm.py -k "borrowed or untuned"; python3 -m pytest -q -m gpu tests/test_spec.py -k distinct
#   Then the drafter inside the verify graph (e38c5fc, CPU-tested only), one H100/H200, ~4 min:
#   PARTS="tests tiny" METHODS=dspark bash scripts/gpu_drafters.sh   (the GPU test of the in-verify blocks against
#   blocks drafted apart, with the verify graphs captured; the tiny eval's acceptance as at baa0320: copy 5.23,
#   reverse 5.94, add 3.39, and 500 / 500 identical; its log's drafted_in_verify / drafted_apart split), and the
#   same for suffix and n-gram as they are now (best-of-every-length suffix, c9a5c78; not run on a GPU since):
#   PARTS=tiny METHODS=suffix,ngram bash scripts/gpu_drafters.sh
#   The review after session 29 (8f72d43: the taps' keys and values in one GEMM and one write in every target step;
#   eeb38f2: the context kernel's shape gate) changes a drafter-carrying decode step: the tiny eval above times it.
#   Not measured for this change, and not yet scriptable as asked: the whole turn with speculation on. gpu_prefill.sh's
#   ttft / serve (TTFT 1K / 8K / 32K cold and repeated, ITL p99 under arrivals) run without a --speculative-config,
#   and bench spec's synthetic-acceptance protocol (rows verified, distinct experts per layer) is greedy only; the
#   replay above is the one run with sampled requests (0.6 / 0.95) beside greedy. Both need that option first.
# - #44 (session 25, CPU): the removed A/B switches and experiments kept the default paths by construction, and the
#   SiTU tanh cap / bounded-gate sigmoid floor give the same FP32 bits; GPU-only code (the MoE down kernel's PDL wait,
#   MXFP4 v3 asm/dot_scaled, the router fusion) was only compile-checked. On one H200, ~8 min, one call:
#   timeout 250 python3 -m pytest -q -m gpu tests/test_kernels_moe.py tests/test_kernels_kda.py tests/test_kernels_gemm.py \
#     tests/test_pdl.py tests/test_kernels_moe_mxfp4.py tests/test_k3_specialized.py tests/test_specialized.py
#   python3 -m peregrine bench decode --model kimi-linear-48b-a3b --dummy-weights --backends latency_specialized \
#     --batch-sizes 1,2,4,8 --input-len 1 --prompt-sets 1 --runs 2 --output-len 256 --temperature 0.6 --top-p 0.95
#   (greedy and sampled in one run, against 2.344-2.357 / 6.855-6.942 ms greedy at c55ca27), then the TTFT and
#   c = 8 serving runs of gpu_prefill.sh to show a whole turn unchanged
# - #45 after session 27 (one H100, results/2026-12-05-session27: v4 57.1 / 60.1 / 61.6 / 63.0 % of copy at
#   B = 1 / 2 / 4 / 8; the k3-slice step 0.86 / 0.80 / 0.74 / 0.65x the BF16 experts'): v4 is now the default on
#   Hopper with the sweep's best tiles per B (B = 1: 8 warps, 128 / 256 rows), which the decode run did not use yet.
#   One H100/H200, ~7 min:  PARTS="tests decode" bash scripts/gpu_mxfp4_v4.sh   (targets left: 60 % and 0.75x at
#   B = 1; the GPU tests now include the one-token config's batch invariance against B = 4)
# - #46 after session 27: the persistent task kernel (kernels/cute/persistent_layer.py) hung on its first run (the
#   consumers' pipeline state was not carried across tasks; rewritten, not run). Here first:
#   bash scripts/build_cute_gpu.sh   (writes .cute/: the dense chain, MoE block and whole KDA layer at B = 1, 2, 4, 8),
#   then on one H100/H200, carry .commit, .whl and .cute, ~4 min, stop at the first hang:
#   timeout 60 python3 -m pytest -x -q -m gpu tests/test_cute_gpu.py -k "1-dense" && \
#   timeout 240 python3 -m pytest -x -q -m gpu tests/test_cute_gpu.py && \
#   timeout 240 python3 -m peregrine.bench.kernels_cute 2>&1 | tee $OUT/log
#   then the layer against today's chain for the same layer on one machine (~6 min, point 1's figure):
#   bash scripts/gpu_persistent_layer.sh   (bench decode with 1 and 2 KDA + MoE layers at the 48B's widths: their
#   difference is one chain layer; then kernels_cute --chain beside it)
source "$(dirname "$0")/device_env.sh"  # repo root, the measured commit, the carried wheels
C="python3 -m peregrine.parallel.check --tp 2 --dtype float32"
exec bash scripts/gpu_lanes.sh \
  "0,1@200:timeout 190 $C --model kimi-linear-48b-a3b --layers 4 --steps 32 --graphs --backends latency_specialized --results-dir results/tp2-graphs 2>&1 | tee \$OUT/graphs.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900" \
  -- \
  "0,1@250:timeout 240 $C --model k3-slice --steps 24 --backends latency_specialized,standard 2>&1 | tee \$OUT/k3.log | grep 'TP=2 vs\|wrote\|teardown' | cut -c1-900"
