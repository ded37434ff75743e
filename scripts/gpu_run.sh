#!/usr/bin/env bash
# One GPU pass on the device machine: GPU tests, kernel microbenchmarks, the
# 48B dummy-weight generate and decode-step benchmark. Results land in results/
# and are bundled into $OUT (the device returns at most 8 files).
#   STEPS="tests kernels generate decode"  which parts to run (default: these four; also tune (GEMM plan),
#                                          moetune, kdatune, mlatune (kernel plans), profile)
#   DECODE_ARGS="..."                      extra args for `bench decode`
source "$(dirname "$0")/device_env.sh"
STEPS=${STEPS:-"tests kernels generate decode"}
MODEL=${MODEL:-kimi-linear-48b-a3b}
DATE=$(date -u +%F)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
cat .commit 2>/dev/null | sed "s/^/commit /" | tee -a "$OUT/gpu.txt"

for s in $STEPS; do
  echo "=== $s ($(date -u +%T))"
  case $s in
    tests)
      # one pytest per file, each with its own time limit: a limit then cuts one file, and every other
      # file's failures still print their tracebacks (pytest prints them only at the end of a run)
      end=$(( $(date +%s) + ${TEST_TIMEOUT:-200} ))
      for f in ${TESTS:-tests/test_kernels_*.py tests/test_specialized.py}; do
        left=$(( end - $(date +%s) )); [ "$left" -lt 10 ] && { echo "SKIPPED (time): $f" | tee -a "$OUT/pytest-gpu.log"; continue; }
        timeout "$left" python3 -m pytest -m gpu -v --timeout=120 --tb=short -p no:cacheprovider "$f" -rf >> "$OUT/pytest-gpu.log" 2>&1
        echo "$f: rc=$?" | tee -a "$OUT/pytest-gpu.log"
      done
      grep -E "passed|failed|FAILED|rc=" "$OUT/pytest-gpu.log" | tail -30 ;;
    tune)  # plan table: heuristic tile vs tensor-core tile vs cuBLAS for every projection shape
      timeout ${TUNE_TIMEOUT:-240} python3 -m peregrine.bench.kernels_gemm --tune --fast --write-plan --results-dir results 2>&1 | tee "$OUT/tune.log" | tail -95
      cp peregrine/kernels/gemm_plan.json "$OUT/" ;;
    moetune)  # MoE router/expert tiles per B -> peregrine/kernels/moe_plan.json (validated against the reference)
      timeout ${MOE_TUNE_TIMEOUT:-200} python3 -m peregrine.bench.kernels_moe --tune --out "$OUT/moe-tune.json" 2>&1 | tee "$OUT/moe-tune.log" | tail -25
      cp peregrine/kernels/moe_plan.json "$OUT/" ;;
    kdatune)  # KDA decode split / finisher / warps per B -> peregrine/kernels/kda_plan.json
      timeout ${KDA_TUNE_TIMEOUT:-300} python3 -m peregrine.bench.kernels_kda --tune 2>&1 | tee "$OUT/kda-tune.log" | tail -45
      cp peregrine/kernels/kda_plan.json "$OUT/" ;;
    mlatune)  # MLA decode tiling and split counts per (cache dtype, B, context bucket) -> peregrine/kernels/mla_plan.json
      timeout ${MLA_TUNE_TIMEOUT:-560} python3 -m peregrine.bench.kernels_mla --tune --budget-s ${MLA_BUDGET_S:-330} 2>&1 | tee "$OUT/mla-tune.log" | tail -70
      cp peregrine/kernels/mla_plan.json "$OUT/" ;;
    profile)  # per-kernel breakdown of one decode step, next to its graph replay time
      timeout ${PROFILE_TIMEOUT:-240} python3 -m peregrine.bench.profile_step --model "$MODEL" --dummy-weights --batch-sizes 1,8 ${PROFILE_ARGS:-} \
        --results-dir results 2>&1 | tee "$OUT/profile.log" | tail -70 ;;
    kernels)
      timeout ${KERNELS_TIMEOUT:-300} python3 -m peregrine.cli bench kernels --results-dir results ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels.log" | tail -60 ;;
    generate)
      timeout 120 python3 -m peregrine.cli generate --model "$MODEL" --dummy-weights --prompt "The quick brown fox" \
        --max-tokens 64 --ignore-eos --timing 2>&1 | tee "results/$DATE-h200-$MODEL-generate.txt" | tail -12 ;;
    decode)
      timeout ${DECODE_TIMEOUT:-540} python3 -m peregrine.cli bench decode --model "$MODEL" --dummy-weights --batch-sizes 1,2,4,8 \
        --input-len 1 --backends standard,latency_specialized --results-dir results ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | tail -40 ;;
  esac
done
tar czf "$OUT/results.tgz" results
ls -la "$OUT"
