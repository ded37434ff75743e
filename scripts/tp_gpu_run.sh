#!/usr/bin/env bash
# Tensor parallel at world TP (env, 2|4|8; needs that many GPUs: nvidia-h200-x2/-x4/-x8), every result
# file named per world (tpN), so TP=2 and TP=4 passes never overwrite each other:
#   check      TP=N vs TP=1, both decode paths, replicated and sliced (tp_slice_replicated): tiny preset
#              (64 greedy steps), then the 48B's first 4 layers at real widths (32 steps) -> results/*-tpN-check.json
#   allreduce  one-shot symmetric memory vs NCCL, B x hidden BF16        -> results/*-tpN-allreduce.json
#   moesplit   experts split: TP inside experts vs expert parallel, B=1..8 (one GPU emulates a rank)
#              -> results/*-moe-split-tpN-bench.json
#   decode     kimi-linear-48b-a3b decode step, TP=N (and TP=1 unless DECODE_TP1=0), both paths
#              -> results/*-decode.json / *-tpN-decode.json; then TP=N specialized with NCCL instead of the
#              one-shot -> results/tpN-nccl/; then TP=N both paths with the router / MLA latent sliced
#              -> results/tpN-slice/
#   k3         the decode step for k3-slice, TP=N and TP=1 (not in the default STEPS)
#   plot       decode step time against TP per B from results/*-decode.json -> results/MODEL-decode-tp.png
# Every step has its own timeout; a failing step is reported and the next one runs.
#   TP=2  STEPS="check allreduce moesplit decode plot"  BATCHES=1,2,4,8  OUTPUT_LEN=48  DECODE_TP1=1
#   DECODE_VARIANTS="main nccl slice"  which TP=N decode runs the decode step makes
source "$(dirname "$0")/device_env.sh"
TP=${TP:-2}
case $TP in 2|4|8) ;; *) echo "TP must be 2, 4 or 8 (got $TP)"; exit 2 ;; esac
STEPS=${STEPS:-"check allreduce moesplit decode plot"}
DECODE_TP1=${DECODE_TP1:-1}
DECODE_VARIANTS=${DECODE_VARIANTS:-"main nccl slice"}
DECODE_TPS=$TP; [ "$DECODE_TP1" = 1 ] && DECODE_TPS="$TP 1"
SLICE='{"tp_slice_replicated": true}'
BATCHES=${BATCHES:-1,2,4,8}
OUTPUT_LEN=${OUTPUT_LEN:-48}
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m 2>&1 | head -5 | tee -a "$OUT/gpu.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
cat .commit 2>/dev/null | sed "s/^/commit /" | tee -a "$OUT/gpu.txt"
BENCH="python3 -m peregrine.cli bench decode --dummy-weights --batch-sizes $BATCHES --input-len 1 --output-len $OUTPUT_LEN
  --prompt-sets 1 --runs 2 --backends standard,latency_specialized --results-dir results"
FILTER="^\[check\] \(building\|initialising\|weights\|caches\|captur\)"
for s in $STEPS; do
  echo "=== $s TP=$TP ($(date -u +%T))"
  case $s in
    check)
      timeout ${CHECK_TIMEOUT:-170} python3 -m peregrine.parallel.check --tp $TP --model tiny-kimi-linear --steps 64 \
        --backends standard,latency_specialized,latency_specialized:nccl,standard:slice,latency_specialized:slice \
        2>&1 | tee "$OUT/check-tiny-tp$TP.log" | grep -v "$FILTER" | tail -12
      timeout ${CHECK_TIMEOUT:-170} python3 -m peregrine.parallel.check --tp $TP --model kimi-linear-48b-a3b --layers 4 --steps 32 \
        --backends standard,latency_specialized,latency_specialized:slice \
        2>&1 | tee "$OUT/check-48b-4l-tp$TP.log" | grep -v "$FILTER" | tail -12 ;;
    allreduce)
      timeout ${ALLREDUCE_TIMEOUT:-120} python3 -m peregrine.bench.allreduce --world $TP --results-dir results 2>&1 | tee "$OUT/allreduce-tp$TP.log" | tail -40 ;;
    moesplit)
      timeout ${MOESPLIT_TIMEOUT:-90} python3 -m peregrine.bench.moe_split --model kimi-linear-48b-a3b --tp $TP --results-dir results 2>&1 | tee "$OUT/moe-split-tp$TP.log" | tail -10 ;;
    decode)
      for v in $DECODE_VARIANTS; do case $v in
        main)
          for tp in $DECODE_TPS; do timeout ${DECODE_TIMEOUT:-200} $BENCH --model kimi-linear-48b-a3b --tensor-parallel-size $tp 2>&1 | tee "$OUT/decode-tp$tp.log" | grep -v "captur" | tail -16; done ;;
        nccl)  # the specialized step with NCCL instead of the one-shot all-reduce (own folder: same file name)
          timeout ${DECODE_TIMEOUT:-200} $BENCH --model kimi-linear-48b-a3b --tensor-parallel-size $TP --backends latency_specialized \
            --additional-config '{"tp_allreduce": "nccl"}' --results-dir results/tp$TP-nccl 2>&1 | tee "$OUT/decode-tp$TP-nccl.log" | grep -v "captur" | tail -10 ;;
        slice)  # router logits and MLA latent sliced per rank + all-gathered, against the replicated run above
          timeout ${DECODE_TIMEOUT:-200} $BENCH --model kimi-linear-48b-a3b --tensor-parallel-size $TP \
            --additional-config "$SLICE" --results-dir results/tp$TP-slice 2>&1 | tee "$OUT/decode-tp$TP-slice.log" | grep -v "captur" | tail -16 ;;
        *) echo "unknown decode variant $v (main nccl slice)" ;;
      esac; done ;;
    k3)
      for tp in $DECODE_TPS; do timeout ${DECODE_TIMEOUT:-200} $BENCH --model k3-slice --tensor-parallel-size $tp 2>&1 | tee "$OUT/decode-k3-tp$tp.log" | grep -v "captur" | tail -16; done ;;
    plot)
      timeout 60 python3 -m peregrine.bench.tp_plot --results-dir results 2>&1 | tee "$OUT/tp-plot.log" | tail -30 ;;
    *)
      echo "unknown step $s (check allreduce moesplit decode k3 plot)" ;;
  esac
done
tar czf "$OUT/results.tgz" results
ls -la "$OUT"
