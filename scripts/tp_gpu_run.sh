#!/usr/bin/env bash
# Tensor parallel on the two-GPU kind (nvidia-h200-x2), one device call (< 10 min):
#   check      TP=2 vs TP=1, both decode paths: tiny preset (64 greedy steps), then the 48B's first
#              4 layers at real widths (32 steps)                        -> results/*-tp2-check.json
#   allreduce  one-shot symmetric memory vs NCCL, B x hidden BF16        -> results/*-tp2-allreduce.json
#   moesplit   experts split: TP inside experts vs expert parallel, B=1..8 (one GPU emulates a rank)
#              -> results/*-moe-split-tp2-bench.json
#   decode     kimi-linear-48b-a3b decode step, TP=1 and TP=2, both paths -> results/*-decode.json,
#              then TP=2 specialized with NCCL instead of the one-shot    -> results/tp2-nccl/
#   k3         the same for k3-slice (not in the default STEPS)
# Every step has its own timeout; a failing step is reported and the next one runs.
#   STEPS="check allreduce moesplit decode"  BATCHES=1,2,4,8  OUTPUT_LEN=48
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps wheels installed by the caller (gpu_lanes.sh)
OUT=${OUT:-/tmp/peregrine-out}
mkdir -p "$OUT" results
STEPS=${STEPS:-"check allreduce moesplit decode"}
BATCHES=${BATCHES:-1,2,4,8}
OUTPUT_LEN=${OUTPUT_LEN:-48}
if [ -d .whl ] && [ -z "${PEREGRINE_WHEELS_DONE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m 2>&1 | head -5 | tee -a "$OUT/gpu.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
cat .commit 2>/dev/null | sed "s/^/commit /" | tee -a "$OUT/gpu.txt"
BENCH="python3 -m peregrine.cli bench decode --dummy-weights --batch-sizes $BATCHES --input-len 1 --output-len $OUTPUT_LEN
  --prompt-sets 1 --runs 2 --backends standard,latency_specialized --results-dir results"
for s in $STEPS; do
  echo "=== $s ($(date -u +%T))"
  case $s in
    check)
      timeout ${CHECK_TIMEOUT:-170} python3 -m peregrine.parallel.check --tp 2 --model tiny-kimi-linear --steps 64 2>&1 | tee "$OUT/check-tiny.log" | grep -v "^\[check\] \(building\|initialising\|weights\|caches\|captur\)" | tail -12
      timeout ${CHECK_TIMEOUT:-170} python3 -m peregrine.parallel.check --tp 2 --model kimi-linear-48b-a3b --layers 4 --steps 32 2>&1 | tee "$OUT/check-48b-4l.log" | grep -v "^\[check\] \(building\|initialising\|weights\|caches\|captur\)" | tail -12 ;;
    allreduce)
      timeout ${ALLREDUCE_TIMEOUT:-120} python3 -m peregrine.bench.allreduce --world 2 --results-dir results 2>&1 | tee "$OUT/allreduce.log" | tail -40 ;;
    moesplit)
      timeout ${MOESPLIT_TIMEOUT:-90} python3 -m peregrine.bench.moe_split --model kimi-linear-48b-a3b --tp 2 --results-dir results 2>&1 | tee "$OUT/moe-split.log" | tail -10 ;;
    decode)
      for tp in 2 1; do timeout ${DECODE_TIMEOUT:-200} $BENCH --model kimi-linear-48b-a3b --tensor-parallel-size $tp 2>&1 | tee "$OUT/decode-tp$tp.log" | grep -v "captur" | tail -16; done
      # the specialized step with NCCL instead of the one-shot all-reduce (own folder: same file name)
      timeout ${DECODE_TIMEOUT:-200} $BENCH --model kimi-linear-48b-a3b --tensor-parallel-size 2 --backends latency_specialized \
        --additional-config '{"tp_allreduce": "nccl"}' --results-dir results/tp2-nccl 2>&1 | tee "$OUT/decode-tp2-nccl.log" | grep -v "captur" | tail -10 ;;
    k3)
      for tp in 2 1; do timeout ${DECODE_TIMEOUT:-200} $BENCH --model k3-slice --tensor-parallel-size $tp 2>&1 | tee "$OUT/decode-k3-tp$tp.log" | grep -v "captur" | tail -16; done ;;
  esac
done
tar czf "$OUT/results.tgz" results
ls -la "$OUT"
