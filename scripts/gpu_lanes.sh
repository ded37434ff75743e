#!/usr/bin/env bash
# Run independent GPU jobs side by side on a multi-GPU device machine, one "lane" per GPU set,
# then bundle everything into at most 8 files (the device returns no more):
#   bash scripts/gpu_lanes.sh "0:STEPS=mlatune bash scripts/gpu_run.sh" "1,2:TP=2 bash scripts/tp_gpu_run.sh"
# A "--" argument starts a new phase: its lanes start when every lane of the previous phase ended
# (e.g. a 4-GPU job first, then single-GPU jobs). LANE_TIMEOUT bounds each lane ("0,1@270:cmd" sets
# one lane's own), DEADLINE the whole
# run (seconds from the start; a later phase's lanes get what is left).
# Each lane runs with CUDA_VISIBLE_DEVICES=<gpus>, its own OUT=$OUT/laneN and log $OUT/laneN.log.
# Lanes on disjoint GPUs share nothing but the host (64 cores on the x4 kind) and the results/ folder,
# whose file names carry the model, kind and TP size. At the end: $OUT/summary.txt (rc and time per lane)
# and $OUT/bundle.tgz (lane folders, logs and results/), split into 15 MB parts when larger.
source "$(dirname "$0")/device_env.sh"  # installs the carried wheels once, for every lane
BUNDLE_PART=15000000  # under the device's 16 MiB per returned file
LANE_TIMEOUT=${LANE_TIMEOUT:-555}  # every lane ends in time to bundle inside the device's 600 s per command
DEADLINE=${DEADLINE:-550}
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/summary.txt"
START=$(date +%s)
i=0
pids=()
run_phase() {  # wait for the lanes started so far
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  pids=()
}
for lane in "$@"; do
  if [ "$lane" = "--" ]; then run_phase; echo "phase ends at $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.txt"; continue; fi
  gpus=${lane%%:*} cmd=${lane#*:}
  lt=$LANE_TIMEOUT
  if [[ $gpus == *@* ]]; then lt=${gpus#*@}; gpus=${gpus%@*}; fi  # "0,1@270:cmd": this lane's own timeout
  left=$(( DEADLINE - ($(date +%s) - START) ))
  t=$(( left < lt ? left : lt ))
  if [ "$t" -lt 10 ]; then echo "lane$i gpus=$gpus skipped (deadline): $cmd" | tee -a "$OUT/summary.txt"; i=$((i + 1)); continue; fi
  mkdir -p "$OUT/lane$i"
  echo "lane$i gpus=$gpus (timeout ${t}s): $cmd" | tee -a "$OUT/summary.txt"
  ( t0=$(date +%s)
    CUDA_VISIBLE_DEVICES=$gpus OUT=$OUT/lane$i timeout -k 5 "$t" bash -c "$cmd" > "$OUT/lane$i.log" 2>&1
    echo "lane$i rc=$? in $(( $(date +%s) - t0 ))s" >> "$OUT/lanes-done.txt" ) &
  pids+=($!)
  i=$((i + 1))
done
run_phase
cat "$OUT/lanes-done.txt" | tee -a "$OUT/summary.txt"
echo "all lanes in $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.txt"
for f in "$OUT"/lane*.log; do echo "===== $f (tail)"; tail -n 15 "$f"; done
cd "$OUT" && tar czf /tmp/bundle.tgz lane* summary.txt -C "$OLDPWD" results && rm -rf "$OUT"/lane* "$OUT/lanes-done.txt"
if [ "$(stat -c %s /tmp/bundle.tgz)" -gt $BUNDLE_PART ]; then
  split -b $BUNDLE_PART -d /tmp/bundle.tgz "$OUT/bundle.tgz.part"
else
  mv /tmp/bundle.tgz "$OUT/bundle.tgz"
fi
ls -la "$OUT"
