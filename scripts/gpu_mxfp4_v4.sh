#!/usr/bin/env bash
# Issue #45 on one H100/H200 (~8 min): the v4 MXFP4 experts (Gluon, kernels/moe_mxfp4_v4.py)
# 1. tests: their GPU tests (T_tests)
# 2. micro: the k3-slice expert microbenchmark, v4's tile sweep beside v3's default and the BF16 experts, same run,
#    copy bandwidth measured in it (VERIFY=1 adds B = 16, 32, 64; T_micro)
# 3. decode: the k3-slice specialized step per form, one machine: MXFP4 v3, MXFP4 v4 (PEREGRINE_MXFP4=v4), BF16
#    experts (the preset without its quantization_config); BATCHES (default 1,2,4,8), T_decode each
#   run (carry .commit and .whl):  PARTS="tests micro decode" bash scripts/gpu_mxfp4_v4.sh
source "$(dirname "$0")/device_env.sh"
rc=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
for p in ${PARTS:-tests micro decode}; do
  echo "=== $p ($(date -u +%T))"
  case $p in
    tests)
      timeout "${T_tests:-240}" python3 -m pytest -q -m gpu tests/test_kernels_moe_mxfp4_v4.py \
        tests/test_k3_specialized.py -k "v4 or verify or gluon or portable or repack or decode_asm or k3_slice" 2>&1 \
        | tee "$OUT/pytest-v4.log" | tail -15 || rc=1 ;;
    micro)
      v=""; [ -n "${VERIFY:-}" ] && v="--verify"
      timeout "${T_micro:-300}" python3 -m peregrine.bench.kernels_moe_mxfp4 --v4 $v --results-dir results 2>&1 \
        | tee "$OUT/micro-v4.log" | grep -v "^{" | tail -30 || rc=1 ;;
    decode)
      bf=/tmp/k3-slice-bf16; mkdir -p $bf
      python3 -c "import json,sys; r=json.load(open('peregrine/presets/k3-slice.json')); r['text_config'].pop('quantization_config', None); json.dump(r, open(sys.argv[1] + '/config.json', 'w'))" $bf
      for form in v3 v4 bf16; do
        m=k3-slice; [ $form = bf16 ] && m=$bf
        PEREGRINE_MXFP4=$([ $form = v4 ] && echo v4 || echo v3) timeout "${T_decode:-120}" python3 -m peregrine bench decode \
          --model $m --dummy-weights --batch-sizes ${BATCHES:-1,2,4,8} --input-len 1 --output-len 48 --prompt-sets 1 \
          --runs 2 --backends latency_specialized --results-dir "results/k3-decode-$form" 2>&1 \
          | tee "$OUT/decode-$form.log" | grep -v captur | tail -8 || rc=1
      done ;;
    *) echo "unknown part $p (tests micro decode)"; rc=1 ;;
  esac
done
# the JSON results as one archive (a call returns at most 8 files: the logs above, gpu.txt and this)
tar czf "$OUT/results-v4.tgz" $(ls results/*kernels-moe-mxfp4*.json results/k3-decode-*/* 2>/dev/null)
exit $rc
