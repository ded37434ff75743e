#!/usr/bin/env bash
# Issue #47's GPU soak: `peregrine serve` (MODEL, dummy weights, latency_specialized) under `peregrine bench soak`
# (mixed traffic: completions and chat, stream or not, n 1..3, logprobs, stop strings, greedy and seeded
# temperature 0.8, shared prefixes, 10 % of streams dropped) for DURATION s at CONC clients, /metrics sampled
# every 30 s (host RSS, GPU memory used and reserved), after WARMUP_LOAD (60) s of the same load (the first
# batched steps' one-time host memory: +114 MB in the first 30 s at 4ce4980, flat after); answers by docs/correctness.md's
# BF16 rule (--answers top5: per-B kernels round differently, so a near-tie may go either way). Once with
# the engine's malloc_trim (default) and, with AB=1, once without (PEREGRINE_MALLOC_TRIM_S=0) before it. Writes results/*-soak-trim{1,0}.json, logs to $OUT.
#   run (carry .commit and .whl):  DURATION=600 CONC=8 bash scripts/gpu_soak.sh
source "$(dirname "$0")/device_env.sh"
MODEL=${MODEL:-kimi-linear-48b-a3b}; CONC=${CONC:-8}; DURATION=${DURATION:-600}; PORT=${PORT:-8013}
URL=http://127.0.0.1:$PORT; rc=0
get() { python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())" "$1" 2>/dev/null; }
modes=${AB:+0 }1
for trim in $modes; do
  env_trim=""; [ "$trim" = 0 ] && env_trim="PEREGRINE_MALLOC_TRIM_S=0"
  env $env_trim python3 -m peregrine serve --model "$MODEL" --dummy-weights --port "$PORT" --max-num-seqs 8 \
      --additional-config '{"decode_backend": "latency_specialized"}' > "$OUT/soak-serve-trim$trim.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 "${READY_TIMEOUT:-400}"); do get "$URL/health" > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  if ! get "$URL/health" > /dev/null; then
    echo "server (trim$trim) did not become healthy"; tail -20 "$OUT/soak-serve-trim$trim.log"; kill -9 $pid 2>/dev/null; rc=1; continue
  fi
  python3 -m peregrine bench soak --base-url "$URL" --duration "$DURATION" --concurrency "$CONC" --sample-every 30 \
      --warmup-load "${WARMUP_LOAD:-60}" --answers top5 \
      --max-growth-mb 100 --out "results/$(date -u +%F)-h200-$MODEL-soak-trim$trim.json" 2>&1 | tee "$OUT/soak-trim$trim.log" || rc=1
  get "$URL/metrics" > "$OUT/soak-metrics-trim$trim.txt"
  kill -TERM $pid; wait $pid; echo "server (trim$trim) exit $?"
done
exit $rc
