#!/usr/bin/env bash
# Issue #5 on one H200: the specialized-path GPU tests, then the decode-step benchmark of
# kimi-linear-48b-a3b with both backends, then the specialized backend again with PDL on
# (results/pdl-on/: same file name), then the PDL microbenchmark. Each part has its own timeout.
#   DECODE_ARGS="--prompt-sets 1 --runs 1 --output-len 128"  BATCHES=1,2,4,8
source "$(dirname "$0")/device_env.sh"
DECODE="python3 -m peregrine.cli bench decode --model kimi-linear-48b-a3b --dummy-weights --batch-sizes ${BATCHES:-1,2,4,8}
  --input-len 1 ${DECODE_ARGS:---prompt-sets 1 --runs 1 --output-len 128}"
echo "=== tests ($(date -u +%T))"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TESTS:-tests/test_specialized.py tests/test_pdl.py} \
  2>&1 | tee "$OUT/pytest-gpu.log" | tail -8
echo "=== decode, both backends ($(date -u +%T))"
timeout ${DECODE_TIMEOUT:-200} $DECODE --backends standard,latency_specialized --results-dir results 2>&1 | tee "$OUT/decode.log" | grep -v captur | tail -14
echo "=== decode, specialized with PDL ($(date -u +%T))"
timeout ${DECODE_TIMEOUT:-200} $DECODE --backends latency_specialized --additional-config '{"pdl": true}' --results-dir results/pdl-on \
  2>&1 | tee "$OUT/decode-pdl.log" | grep -v captur | tail -10
echo "=== PDL microbenchmark ($(date -u +%T))"
timeout ${PDL_TIMEOUT:-150} python3 -m peregrine.bench.pdl 2>&1 | tee "$OUT/pdl.log" | tail -14
