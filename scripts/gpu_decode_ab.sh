#!/usr/bin/env bash
# #20's decode-step A/B as one device call (one H200; ~1 min per variant on a warm machine):
#   run (carry .commit):  GEMM_TUNE=1 TESTS="tests/test_kernels_moe.py" AB="base PEREGRINE_GEMM_PLAN=$OUT/gemm_plan_pdl.json" \
#                         bash scripts/gpu_decode_ab.sh
# TESTS  pytest -m gpu arguments run first, e.g. "tests/test_kernels_moe.py -k router" (log: $OUT/pytest.log)
# TUNE_SHARED=1  re-tune moe_plan.json's '+shared' experts entry first (the device's plan file, copied to $OUT)
# GEMM_TUNE=1    re-tune the 48B decode GEMMs under PDL into $OUT/gemm_plan_pdl.json (not the tree's plan:
#                an AB variant selects it with PEREGRINE_GEMM_PLAN=$OUT/gemm_plan_pdl.json); GEMM_SHAPES (a
#                kernels_gemm --shapes set, default decode48b), GEMM_MS (default 1,2,4,8), GEMM_SWEEP (default --wide)
# ROUTER_TUNE=1  re-tune the router alone (kernels_moe --tune --router-only) into the tree's plan
# MICRO  microbenchmark modules, ';'-separated (e.g. "kernels_moe --shared --quick;kernels_gemm --grouped"), logged to $OUT; T_MICRO each one's limit (default 200 s)
# AB     variants of `bench decode`, each "name" or "NAME=value[,NAME=value]" env settings; one results dir each
# TIMELINE=1  step_timeline for the first variant (the profile of graph replays) at TIMELINE_BS (default 1,8);
#             TIMELINE_ARGS more step_timeline flags (e.g. --distinct-tokens: every batch row its own token)
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
if [ -n "${TESTS:-}" ]; then
  eval "timeout ${T_TESTS:-240} python3 -m pytest -q -m gpu $TESTS" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -n 3 "$OUT/pytest.log"
fi
if [ "${TUNE_SHARED:-0}" = 1 ]; then
  timeout 200 python3 -m peregrine.bench.kernels_moe --shared --tune --results-dir "$OUT/micro" > "$OUT/tune-shared.log" 2>&1
  echo "tune-shared rc=$?"; cp peregrine/kernels/moe_plan.json "$OUT/moe_plan.json"
fi
if [ "${GEMM_TUNE:-0}" = 1 ]; then  # merged into a copy of the tree's plan: the other shapes keep their entries
  cp peregrine/kernels/gemm_plan.json "$OUT/gemm_plan_pdl.json"
  timeout ${T_GEMM:-240} python3 -m peregrine.bench.kernels_gemm --tune ${GEMM_SWEEP:---wide} --pdl --shapes ${GEMM_SHAPES:-decode48b} \
    --ms ${GEMM_MS:-1,2,4,8} --write-plan \
    --plan-out "$OUT/gemm_plan_pdl.json" --results-dir "$OUT/micro" > "$OUT/tune-gemm.log" 2>&1; echo "tune-gemm rc=$?"
fi
if [ "${ROUTER_TUNE:-0}" = 1 ]; then  # the router's entry into the tree's plan
  timeout 200 python3 -m peregrine.bench.kernels_moe --tune --router-only --results-dir "$OUT/micro" > "$OUT/tune-router.log" 2>&1
  echo "tune-router rc=$?"; cp peregrine/kernels/moe_plan.json "$OUT/moe_plan.json"
fi
IFS=';' read -ra micros <<< "${MICRO:-}"
for m in "${micros[@]}"; do
  name=$(echo "$m" | tr ' -' '__')
  timeout ${T_MICRO:-200} python3 -m peregrine.bench.$m --results-dir "$OUT/micro" > "$OUT/micro-$name.log" 2>&1; echo "$m rc=$?"
  tail -n 14 "$OUT/micro-$name.log"
done
first=1
for v in ${AB:-base}; do
  envs=(); [ "$v" != base ] && IFS=, read -ra envs <<< "$v"
  dir="$OUT/decode-$(echo "$v" | tr "=,/" "-__")"
  env "${envs[@]}" timeout 240 python3 -m peregrine.cli bench decode --model kimi-linear-48b-a3b --dummy-weights \
    --backends latency_specialized --batch-sizes 1,2,4,8 --input-len 1 --prompt-sets 2 --runs 1 --output-len 256 \
    --results-dir "$dir" > "$dir.log" 2>&1
  echo "decode $v rc=$?"; tail -n 8 "$dir.log"
  if [ "$first" = 1 ] && [ "${TIMELINE:-0}" = 1 ]; then
    env "${envs[@]}" timeout 200 python3 -m peregrine.bench.step_timeline --dummy-weights --batch-sizes "${TIMELINE_BS:-1,8}" ${TIMELINE_ARGS:-} --results-dir "$OUT/timeline" \
      > "$OUT/timeline.log" 2>&1; echo "timeline rc=$?"
  fi
  first=0
done
# a call returns at most 8 files: everything in one archive, the logs' tails above in the output
tar czf /tmp/bundle.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/bundle.tgz "$OUT/bundle.tgz"
