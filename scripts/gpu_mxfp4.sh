#!/usr/bin/env bash
# #20 item 4 (MXFP4 experts, K3) as one device call on one H200 (~8 min):
#   run (carry .commit):  bash scripts/gpu_mxfp4.sh
# 1. the k3-slice decode step (latency_specialized, dummy weights) per MXFP4 decode, one results dir each
#    (DECODES, default "default": the GPU's default; e.g. "asm dot_scaled" sets PEREGRINE_MXFP4_V3_DECODE;
#    BATCHES 1,8; DECODE=0 skips the step)
# 2. the GPU tests of the MXFP4 kernels and of K3's specialized path (TESTS, T_TESTS default 150 s)
# 3. the MXFP4 expert microbenchmark with its tile and decode sweep (T_MICRO 200 s)
# Everything lands in $OUT as one archive; the logs' tails print as it goes.
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
for v in ${DECODES:-default}; do
  [ "${DECODE:-1}" = 0 ] && break
  dec=""; [ "$v" != default ] && dec=$v
  PEREGRINE_MXFP4_V3_DECODE=$dec timeout ${T_DECODE:-100} python3 -m peregrine.cli bench decode --model k3-slice \
    --dummy-weights --batch-sizes ${BATCHES:-1,8} --input-len 1 --output-len 48 --prompt-sets 1 --runs 2 \
    --backends latency_specialized --results-dir "$OUT/decode-$v" > "$OUT/decode-$v.log" 2>&1
  echo "decode $v rc=$?"; tail -n 6 "$OUT/decode-$v.log"
done
eval "timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/test_kernels_moe_mxfp4.py tests/test_k3_specialized.py}" \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -n 3 "$OUT/pytest.log"
timeout ${T_MICRO:-200} python3 -m peregrine.bench.kernels_moe_mxfp4 --results-dir "$OUT/micro" \
  > "$OUT/micro.log" 2>&1
echo "micro rc=$?"; tail -n 7 "$OUT/micro.log"
tar czf /tmp/bundle.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/bundle.tgz "$OUT/bundle.tgz"
