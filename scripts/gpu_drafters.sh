#!/usr/bin/env bash
# Issue #43 on the GPU: drafters' acceptance with the verify width chooser (its cost table measured from the
# verify graphs at start) and their answers against plain greedy.
# 1. replay: the 48B (dummy weights, needs an H200: BF16 does not fit an H100) on agent-shaped sessions at B = 1,
#    replies forced, plain / n-gram / suffix at k = 7 (T_replay; SESSIONS, TURNS, CONTEXT characters: the defaults
#    2 x 10 turns, 320 000 characters reach 30K and 38K tokens at the last turns); replay_mxfp4: the same with the
#    48B's experts in MXFP4 (a config made here from the preset), which fits one H100; REPLAY_ARGS e.g.
#    "--replay-temperature 1 --replay-top-p 0.95" (sampled requests, the server's default temperature)
# 2. tiny: peregrine-tiny-dspark against suffix and n-gram, N problems per task (500), fast path at B <= 8, TASKS
#    (default all four), METHODS (default dspark,suffix,ngram); an answer unlike plain greedy is reported with the plain top 5 where it differs (T_tiny)
# 3. tests: the drafters' GPU tests (the in-place context attention kernel; the drafter's CUDA graphs against its
#    eager step; T_tests)
#   run (carry .commit and .whl):  PARTS="replay tiny tests" bash scripts/gpu_drafters.sh
source "$(dirname "$0")/device_env.sh"
rc=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
for p in ${PARTS:-replay tiny tests}; do
  echo "=== $p ($(date -u +%T))"
  case $p in
    replay)
      timeout "${T_replay:-540}" python3 -m peregrine bench spec --model kimi-linear-48b-a3b --dummy-weights --k 7 \
        --replay-sessions "${SESSIONS:-2}" --replay-turns "${TURNS:-10}" --replay-context "${CONTEXT:-320000}" \
        --replay-methods ngram,suffix ${REPLAY_ARGS:-} --results-dir results/spec-replay 2>&1 | tee "$OUT/replay.log" \
        | grep -v "captur" | tail -25 || rc=1 ;;
    replay_mxfp4)  # the same on one H100: the 48B's experts in MXFP4 (K3's format, dummy codes), 30 GB in all
      M=/tmp/kimi-linear-48b-a3b-mxfp4; mkdir -p $M
      python3 -c "import json; d = json.load(open('peregrine/presets/kimi-linear-48b-a3b.json'))
d['quantization_config'] = {'format': 'mxfp4-pack-quantized', 'quant_method': 'compressed-tensors'}
json.dump(d, open('$M/config.json', 'w'), indent=1)"
      timeout "${T_replay:-540}" python3 -m peregrine bench spec --model $M --dummy-weights --k 7 \
        --replay-sessions "${SESSIONS:-2}" --replay-turns "${TURNS:-10}" --replay-context "${CONTEXT:-320000}" \
        --replay-methods ngram,suffix --results-dir results/spec-replay 2>&1 | tee "$OUT/replay-mxfp4.log" \
        | grep -v "captur" | tail -25 || rc=1 ;;
    tiny)
      timeout "${T_tiny:-540}" python3 -m peregrine.train.drafter --eval peregrine-tiny-dspark --n "${N:-500}" --tasks "${TASKS:-copy,reverse,add,recall}" \
        --methods "${METHODS:-dspark,suffix,ngram}" \
        --out "results/tiny-dspark-gpu-${TASKS:-all}-${METHODS:-all}.json" 2>&1 | tee "$OUT/tiny.log" | tail -25 || rc=1 ;;
    tests)
      timeout "${T_tests:-120}" python3 -m pytest -q -m gpu tests/test_kernels_drafter_attn.py tests/test_dflash.py \
        tests/test_spec_suffix.py 2>&1 \
        | tee "$OUT/pytest-drafters.log" | tail -8 || rc=1 ;;
    *) echo "unknown part $p (replay replay_mxfp4 tiny tests)"; rc=1 ;;
  esac
done
tar czf "$OUT/results-drafters.tgz" $(ls results/spec-replay/* results/tiny-dspark-gpu-*.json 2>/dev/null)
exit $rc
