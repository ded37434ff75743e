#!/usr/bin/env bash
# Prefill / prefix caching / chunked mixing on one H200 (issue: time to first token at agent-size contexts).
#   STEPS: any of tests hf kernels kdarows profile glue moegrouped ttft serve (default: tests kernels ttft serve, in that order); TESTS (test
#   files) and K (a pytest -k filter) for tests; hf: the transformers conformance test; MODEL (kimi-linear-48b-a3b);
#   LENGTHS (1024,8192,32768,131072); CHUNKS/CONTEXT/AB (interleaved eager vs prefill-graph runs)/BUDGET (tokens per step)/SHAPES=1/STACKS=1 (Python stacks in the idle-gap listing)/SYNC=1 (host phases and every host sync of a cold first token) for profile; RUNS (3); CONC (1,4,8); T_<step> seconds per step (a killed step
#   still leaves its log and the bundle); BACKEND, PG (true: prefill graphs; e.g. "false true"), BREAKDOWN (32768; 0: none), MNBT (tokens per step, e.g. "8192 32768") for ttft
# Results go to results/, logs to $OUT/logs; both come back as $OUT/bundle.tgz, with only the results files this run
#   wrote (the device returns 8 files a call: give each run its own OUT and keep the count down).
source "$(dirname "$0")/device_env.sh"
TOP=$OUT; OUT=$OUT/logs; mkdir -p "$OUT"
STEPS=${STEPS:-"tests kernels ttft serve"}
MODEL=${MODEL:-kimi-linear-48b-a3b}
LENGTHS=${LENGTHS:-1024,8192,32768,131072}
rc=0
touch "$TOP/.t0"  # the bundle takes only the results files this run writes (the tree's old ones stay out)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import fla, torch, triton; print('fla', fla.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
for step in $STEPS; do
  t0=$(date +%s)
  lim=T_$step; lim=${!lim:-300}
  case $step in
    tests)
      timeout -k 5 "$lim" python3 -m pytest -v --durations=15 -m gpu ${TESTS:-tests/test_kernels_mla_prefill.py tests/test_prefill.py} \
        ${K:+-k "$K"} 2>&1 | tee "$OUT/pytest-prefill.log" || rc=1 ;;
    hf)
      timeout -k 5 "$lim" python3 -m pytest -v --durations=10 tests/test_hf_conformance.py 2>&1 | tee "$OUT/pytest-hf.log" || rc=1 ;;
    kdarows)
      timeout -k 5 "$lim" python3 -m peregrine.bench.kda_rows --model "$MODEL" ${KDA_LENGTHS:+--lengths "$KDA_LENGTHS"} 2>&1 \
        | tee "$OUT/kda-rows.log" || rc=1 ;;
    profile)
      timeout -k 5 "$lim" python3 -m peregrine.bench.profile_prefill --model "$MODEL" --dummy-weights \
        --chunks "${CHUNKS:-1024,8192}" --context "${CONTEXT:-32768}" --ab-runs "${AB:-0}" --budget "${BUDGET:-0}" ${SHAPES:+--shapes} ${STACKS:+--stacks} ${SYNC:+--sync-debug} 2>&1 | tee "$OUT/profile-prefill.log" || rc=1 ;;
    glue)  # the MoE prefill glue kernels: GPU tests, then their microbenchmark against the torch forms
      timeout -k 5 "$lim" python3 -m pytest -v tests/test_kernels_moe_prefill.py 2>&1 | tee "$OUT/pytest-glue.log" || rc=1
      timeout -k 5 "$lim" python3 -m peregrine.bench.kernels_moe_prefill 2>&1 | tee "$OUT/kernels-moe-prefill.log" || rc=1 ;;
    moegrouped)  # the prefill MoE's grouped GEMMs against their floors, 64 to 32K tokens
      timeout -k 5 "$lim" python3 -m peregrine.bench.moe_grouped 2>&1 | tee "$OUT/moe-grouped.log" || rc=1 ;;
    kernels)
      timeout -k 5 "$lim" python3 -m peregrine bench kernels --families mla_prefill 2>&1 | tee "$OUT/kernels-mla-prefill.log" || rc=1 ;;
    ttft)  # once per PG value (prefill graphs true/false) and MNBT value (tokens per step; 0: the engine's), in results/pg-<pg>-b<mnbt>/
      for pg in ${PG:-true}; do for b in ${MNBT:-0}; do
        timeout -k 5 "$lim" python3 -m peregrine bench ttft --model "$MODEL" --dummy-weights --lengths "$LENGTHS" \
          --runs "${RUNS:-3}" --breakdown-len "${BREAKDOWN:-32768}" --results-dir "results/pg-$pg-b$b" --additional-config \
          "{\"decode_backend\": \"${BACKEND:-latency_specialized}\", \"prefill_graphs\": $pg}" \
          $([ "$b" != 0 ] && echo --max-num-batched-tokens "$b") 2>&1 | tee "$OUT/ttft-pg-$pg-b$b.log" || rc=1
      done; done ;;
    serve)
      BACKENDS=${BACKENDS:-latency_specialized} CONC=${CONC:-1,4,8} MODEL=$MODEL OUT=$OUT timeout -k 5 "$lim" \
        bash scripts/gpu_serve.sh 2>&1 \
        | tee "$OUT/serve.log" || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 ))s" | tee -a "$TOP/steps.txt"
done
find results -type f -newer "$TOP/.t0" > "$TOP/new-results.txt"
tar czf "$TOP/bundle.tgz" -C "$TOP" logs -C "$PWD" -T "$TOP/new-results.txt" && rm -rf "$OUT" "$TOP/.t0" "$TOP/new-results.txt"
exit $rc
