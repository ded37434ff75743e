#!/usr/bin/env bash
# Speculative decoding on one H200 (issue #10), self-driving, < 8 min: GPU tests of the verify path
# (graphs per (B, T), near-tie rule in BF16), then `bench spec` for peregrine-tiny (trained weights
# when peregrine/presets/peregrine-tiny/ exists, else dummy) and kimi-linear-48b-a3b (dummy weights):
# plain vs n-gram vs oracle drafts at B = 1, 2, 4, k = 2, 4. JSON + Markdown land in results/ and $OUT.
#   STEPS="tests tiny 48b"  which parts to run (default: all); SPEC_ARGS="..." extra `bench spec` args
source "$(dirname "$0")/device_env.sh"
STEPS=${STEPS:-"tests tiny 48b"}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
cat .commit 2>/dev/null | sed "s/^/commit /" | tee -a "$OUT/gpu.txt"
TINY_W="--dummy-weights"
[ -d peregrine/presets/peregrine-tiny ] && TINY_W=""
COMMON="--batch-sizes 1,2,4 --k 2,4 --input-len 256 --output-len 128 --pattern-len 16 --runs 2 --results-dir results"
for s in $STEPS; do
  echo "=== $s ($(date -u +%T))"
  case $s in
    tests)
      timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_spec_specialized.py -rf 2>&1 \
        | tee "$OUT/pytest-spec-gpu.log" | tail -20 ;;
    tiny)
      timeout ${TINY_TIMEOUT:-90} python3 -m peregrine.cli bench spec --model peregrine-tiny $TINY_W $COMMON ${SPEC_ARGS:-} 2>&1 \
        | tee "$OUT/spec-tiny.log" | tail -25 ;;
    48b)
      timeout ${BIG_TIMEOUT:-270} python3 -m peregrine.cli bench spec --model kimi-linear-48b-a3b --dummy-weights $COMMON ${SPEC_ARGS:-} 2>&1 \
        | tee "$OUT/spec-48b.log" | tail -25 ;;
  esac
done
cp results/*-spec-*.json results/*-spec-*.md "$OUT/" 2>/dev/null
ls -la "$OUT"
