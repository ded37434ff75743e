#!/usr/bin/env bash
# Serving benchmark (docs/benchmarks.md §3) for each decode backend on this machine: start
# `peregrine serve`, wait for /health, drive it with `peregrine bench serve`, save /metrics,
# SIGTERM (drains), next backend; then one plot of both. Server logs and metrics go to $OUT.
#   MODEL (kimi-linear-48b-a3b, dummy weights), BACKENDS, CONC (1,2,4,8), ISL (1024), OSL (128),
#   NP (requests per level; default 5 x concurrency), RATE (Poisson arrivals/s), PORT, READY_TIMEOUT (s),
#   SAMPLING (bench serve's sampling flags, e.g. "--temperature 0.6 --top-p 0.95"; its runs are labelled -sampled).
#   SERVE_FLAGS: more server flags, no spaces inside one (e.g. --kv-events-config '{"enable_kv_cache_events":true}').
#   A BACKENDS entry "backend@N" also sets prefill_piece_layers N (label backend-piecesN): same-run A/B;
#   a ":nographs" suffix turns prefill graphs off (label ...-nographs); "backend@N+T" prefills at most T tokens
#   per step beside running decodes (--max-prefill-tokens-while-decoding, label ...-whiledecodingT),
#   e.g. latency_specialized@6+4096:nographs
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .commit ] && export PEREGRINE_COMMIT=${PEREGRINE_COMMIT:-$(cat .commit)}  # the device copy's git HEAD can be stale
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" results
PY=${PY:-python3}
MODEL=${MODEL:-kimi-linear-48b-a3b}; BACKENDS=${BACKENDS:-"standard latency_specialized"}
CONC=${CONC:-1,2,4,8}; ISL=${ISL:-1024}; OSL=${OSL:-128}; PORT=${PORT:-8011}
NP_ARG=${NP:+--num-prompts $NP}
RATE_ARG=${RATE:+--request-rate $RATE}  # RATE: Poisson arrivals per second (default: all at once)
URL=http://127.0.0.1:$PORT
get() { $PY -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())" "$1" 2>/dev/null; }
runs=(); rc=0
for spec in $BACKENDS; do
  extra=""; label=""
  if [[ $spec == *:nographs ]]; then spec=${spec%:nographs}; extra=", \"prefill_graphs\": false"; label="-nographs$label"; fi
  flags=""
  if [[ $spec == *+* ]]; then flags="--max-prefill-tokens-while-decoding ${spec#*+}"; label="-whiledecoding${spec#*+}$label"; spec=${spec%+*}; fi
  be=${spec%@*}
  if [[ $spec == *@* ]]; then extra="$extra, \"prefill_piece_layers\": ${spec#*@}"; label="$be-pieces${spec#*@}$label"; else label=$be$label; fi
  PEREGRINE_LOG_COMPILES=1 $PY -m peregrine serve --model "$MODEL" --dummy-weights --port "$PORT" --max-num-seqs 8 $flags ${SERVE_FLAGS:-} \
      --additional-config "{\"decode_backend\": \"$be\"$extra}" > "$OUT/serve-$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 "${READY_TIMEOUT:-300}"); do
    get "$URL/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if ! get "$URL/health" > /dev/null; then
    echo "server ($label) did not become healthy; log tail:"; tail -20 "$OUT/serve-$label.log"; kill -9 $pid 2>/dev/null; rc=1; continue
  fi
  [ -n "${SAMPLING:-}" ] && label="$label-sampled"
  $PY -m peregrine bench serve --base-url "$URL" --max-concurrency "$CONC" --input-len "$ISL" --output-len "$OSL" \
      $NP_ARG $RATE_ARG ${SAMPLING:-} --label "$label" --results-dir results 2>&1 | tee "$OUT/bench-serve-$label.log" || rc=1
  get "$URL/metrics" > "$OUT/metrics-$label.txt"
  kill -TERM $pid; wait $pid; echo "server ($label) exit $?"
  runs+=("$(ls -t results/*-"$MODEL"-serve-"$label".json | head -1)")
done
[ ${#runs[@]} -gt 0 ] && $PY -m peregrine.bench.serve "results/$(basename "${runs[0]%-serve-*}")-serve.png" "${runs[@]}"
exit $rc
