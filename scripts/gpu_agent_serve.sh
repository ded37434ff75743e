#!/usr/bin/env bash
# Issue #57 item 2's serving target, in one device call of at most 9 minutes: `bench serve --workload agent` at
# c = 8 (8 coding-agent sessions, every turn re-sending the conversation, each reply sent as forced_tokens) against
# the 48B (dummy weights) served with suffix speculation and then without, both latency_specialized with
# --allow-forced-replies:
#   suffix server: greedy (seed 0), sampled 0.6 / 0.95 (seed 1: other sessions, so the suffix trie of the greedy
#                  run's replies does not help it)
#   plain server:  the same two, then greedy with --unforced (the model's own replies, same prompts and
#                  max_tokens): forced rows keep decode lookahead, and this run shows the forced ones cost the same
# Every run opens its sessions with its own salt, so none reuses another's cached prefixes. An H200 runs the BF16
# 48B; an H100 (80 GB) the 48B with MXFP4 experts, as scripts/gpu_check.sh builds it. JSON (GPU, commit) under
# results/agent-serve/ and in $OUT/agent-serve-results.tgz; server logs and /metrics in $OUT. Printed last: the
# targets' table (python -m peregrine.bench.check): TPOT p50 spec / plain <= 0.8, TTFT p50 spec / plain <= 1.05,
# ITL p99 spec <= 25 ms, 0 errors.
#   run (carry .commit):  bash scripts/gpu_agent_serve.sh
#   BUDGET_S (520), READY_TIMEOUT (240 s a server start), T_RUN (150 s a run), TURNS (8), CHARS (120000),
#   SPEC ('{"method": "suffix", "num_speculative_tokens": 7}'), MAXLEN (32768), PORT (8013), MODEL (a preset or
#   folder instead of the 48B), BENCH_FLAGS (more bench serve flags, e.g. "--max-reply-tokens 64")
source "$(dirname "$0")/device_env.sh"
start=$(date +%s); budget=${BUDGET_S:-520}
left() { echo $(( budget - ($(date +%s) - start) )); }
R=results/agent-serve; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "commit ${PEREGRINE_COMMIT:-unknown}" | tee -a "$OUT/gpu.txt"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
M=${MODEL:-kimi-linear-48b-a3b}
if [ -z "${MODEL:-}" ] && [ "${mib:-0}" -lt 100000 ]; then  # the BF16 48B needs more than 80 GB: its experts in MXFP4 (K3's format)
  M=/tmp/kimi-linear-48b-a3b-mxfp4; mkdir -p $M
  python3 -c "import json; d = json.load(open('peregrine/presets/kimi-linear-48b-a3b.json'))
d['quantization_config'] = {'format': 'mxfp4-pack-quantized', 'quant_method': 'compressed-tensors'}
json.dump(d, open('$M/config.json', 'w'), indent=1)"
fi
echo "model $M" | tee -a "$OUT/gpu.txt"
SPEC=${SPEC:-'{"method": "suffix", "num_speculative_tokens": 7}'}
PORT=${PORT:-8013}; URL=http://127.0.0.1:$PORT
SAMP="--temperature 0.6 --top-p 0.95"
get() { python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())" "$1" 2>/dev/null; }
rc=0; pid=""

serve() {  # serve NAME [extra serve flags...]: start, wait for /health (false when it did not come up)
  local name=$1; shift
  echo "=== server $name ($(date -u +%T), $(left) s left)"
  PEREGRINE_LOG_COMPILES=1 python3 -m peregrine serve --model "$M" --dummy-weights --port "$PORT" --max-num-seqs 8 \
    --max-model-len "${MAXLEN:-32768}" --allow-forced-replies \
    --additional-config '{"decode_backend": "latency_specialized"}' "$@" > "$OUT/serve-$name.log" 2>&1 &
  pid=$!
  local t0; t0=$(date +%s)
  while (( $(date +%s) - t0 < ${READY_TIMEOUT:-240} )); do
    get "$URL/health" > /dev/null && { echo "up in $(( $(date +%s) - t0 )) s"; return 0; }
    kill -0 $pid 2>/dev/null || break
    sleep 2
  done
  echo "server $name did not become healthy; log tail:"; tail -20 "$OUT/serve-$name.log"; stop; rc=1; return 1
}

stop() {  # SIGTERM (drains), then SIGKILL after 30 s
  [ -z "$pid" ] && return
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; pid=""
}

bench() {  # bench LABEL [bench serve flags...]: one agent run at c = 8, if the budget has room for it
  local label=$1; shift
  local t=${T_RUN:-150}
  (( $(left) < t / 2 )) && { echo "--- $label skipped: $(left) s left"; return; }
  (( t > $(left) )) && t=$(left)
  echo "--- $label ($(date -u +%T), $(left) s left)"
  timeout "$t" python3 -m peregrine bench serve --base-url "$URL" --workload agent --max-concurrency 8 \
    --turns "${TURNS:-8}" --context-chars "${CHARS:-120000}" --warmup 2 --timeout 120 --no-plot --results-dir "$R" \
    --label "$label" --salt "$label" ${BENCH_FLAGS:-} "$@" 2>&1 | tee "$OUT/bench-$label.log"
  local st=${PIPESTATUS[0]}
  [ "$st" = 0 ] || rc=1
  [ "$st" = 124 ] && echo "$label cut at $t s"
}

if serve suffix --speculative-config "$SPEC"; then
  bench suffix-greedy --seed 0
  (( $(left) > 330 )) && bench suffix-sampled --seed 1 $SAMP  # leaves the plain server's start and greedy run
  get "$URL/metrics" > "$OUT/metrics-suffix.txt"
  stop
fi
if (( $(left) > 150 )) && serve plain; then
  bench plain-greedy --seed 0
  ls "$R"/*-suffix-sampled.json > /dev/null 2>&1 && bench plain-sampled --seed 1 $SAMP
  bench plain-unforced-greedy --seed 0 --unforced
  get "$URL/metrics" > "$OUT/metrics-plain.txt"
  stop
fi
tar czf "$OUT/agent-serve-results.tgz" "$R"
echo "=== verdict ($(( $(date +%s) - start )) s)"
python3 -m peregrine.bench.check "$R" --out "$OUT/agent-check.json" || rc=1
exit $rc
