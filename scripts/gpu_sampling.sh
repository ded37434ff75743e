#!/usr/bin/env bash
# Issue #41 on one H200: the sampler's microbenchmark, the sampled decode step beside the greedy one
# (bench decode measures both in one engine), the GPU tests in BF16, and serving at c = 8 greedy vs
# sampled against one server (alternated, so drift hits both). Logs to $OUT, JSON to results/.
#   run (carry .commit and .whl):  PARTS="kernels decode tests serve" bash scripts/gpu_sampling.sh
#   SAMP (default "--temperature 0.6 --top-p 0.95"), LOGPROBS (decode: "0 5", each a run; 0 = none),
#   T_<part> (timeouts, s), ROUNDS (serve, default 2)
source "$(dirname "$0")/device_env.sh"
M="--model kimi-linear-48b-a3b --dummy-weights"
SAMP=${SAMP:-"--temperature 0.6 --top-p 0.95"}
TESTS="tests/test_kernels_sampling.py tests/test_lookahead.py tests/test_outputs.py tests/test_specialized.py"
K="sampl or logprob or penalt or min_tokens or lookahead or graph"
PORT=${PORT:-8012}; URL=http://127.0.0.1:$PORT
get() { python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())" "$1" 2>/dev/null; }
rc=0
for p in ${PARTS:-kernels decode tests serve}; do
  echo "=== $p ($(date -u +%T))"
  case $p in
    kernels)
      timeout "${T_kernels:-150}" python3 -m peregrine.bench.kernels_sampling --results-dir results 2>&1 \
        | tee "$OUT/kernels-sampling.log" | tail -40 || rc=1 ;;
    decode)
      for n in ${LOGPROBS:-0 5}; do  # 0: sampled only; N: sampled with logprobs top-N
        lp=""; [ "$n" != 0 ] && lp="--logprobs $n"
        timeout "${T_decode:-200}" python3 -m peregrine bench decode $M --backends latency_specialized \
          --batch-sizes 1,2,4,8 --input-len 1 --prompt-sets 1 --runs 2 --output-len 256 $SAMP $lp \
          --results-dir results 2>&1 | tee -a "$OUT/decode-sampled.log" | grep -v captur | tail -16 || rc=1
      done ;;
    tests)
      timeout "${T_tests:-300}" python3 -m pytest -q -m gpu $TESTS -k "$K" 2>&1 \
        | tee "$OUT/pytest-sampling.log" | tail -15 || rc=1 ;;
    serve)
      python3 -m peregrine serve $M --port "$PORT" --max-num-seqs 8 \
        --additional-config '{"decode_backend": "latency_specialized"}' > "$OUT/serve.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 "${READY_TIMEOUT:-300}"); do get "$URL/health" > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
      if ! get "$URL/health" > /dev/null; then echo "server did not become healthy"; tail -20 "$OUT/serve.log"; kill -9 $pid; rc=1; continue; fi
      for r in $(seq 1 "${ROUNDS:-2}"); do
        for mode in greedy sampled; do
          s=""; [ $mode = sampled ] && s=$SAMP
          python3 -m peregrine bench serve --base-url "$URL" --max-concurrency 8 --num-prompts 40 --input-len 1024 \
            --output-len 128 $s --label "c8-$mode-r$r" --no-plot --results-dir results 2>&1 \
            | tee -a "$OUT/bench-serve.log" | grep -i "tpot\|itl\|ttft\|error" || rc=1
        done
      done
      get "$URL/metrics" > "$OUT/serve-metrics.txt"
      kill -TERM $pid; wait $pid; echo "server exit $?" ;;
    *) echo "unknown part $p (kernels decode tests serve)"; rc=1 ;;
  esac
done
exit $rc
