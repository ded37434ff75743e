#!/usr/bin/env bash
# A second training stage for peregrine-tiny on one GPU (issue #7: addition was 0.84 after the first
# 7.6 min run and still climbing), then the GPU evals of the new weights: accuracy per task and
# standard vs latency_specialized greedy answers. Weights land in $OUT/peregrine-tiny/ (21.7 MB: the
# caller bundles/splits them; the device returns files of at most 16 MiB).
#   MINUTES=6  MIX=add=0.7,copy=0.15,reverse=0.15  N=500  TRAIN_ARGS="..."
source "$(dirname "$0")/device_env.sh"
DIR=$OUT/peregrine-tiny  # the folder name is the model name in the eval result files
timeout $(( ${MINUTES:-6} * 60 + 120 )) python3 -m peregrine.train.train --init peregrine/presets/peregrine-tiny \
  --short-mix "${MIX:-add=0.7,copy=0.15,reverse=0.15}" --recall-every 4 --lr 1e-3 --warmup 50 --batch 1024 --chunk 16 \
  --minutes "${MINUTES:-6}" --eval-every 400 --log-every 100 --device cuda --out "$DIR" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
[ -f "$DIR/model.safetensors" ] || { echo "no weights written"; exit 1; }
PY=python3 N=${N:-500} STAGES="acc spec" timeout ${EVAL_TIMEOUT:-200} bash scripts/eval_tiny.sh --model "$DIR" --device cuda 2>&1 | tee "$OUT/eval.log"
