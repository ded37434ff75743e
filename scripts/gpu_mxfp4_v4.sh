#!/usr/bin/env bash
# Issue #45 on one H100/H200: the v4 MXFP4 experts (Gluon, kernels/moe_mxfp4_v4.py) - their GPU tests, then the
# k3-slice microbenchmark with v4's tile sweep beside v3's default and the BF16 experts, same run, copy bandwidth
# measured in it. Logs to $OUT, JSON to results/.
#   run (carry .commit and .whl):  bash scripts/gpu_mxfp4_v4.sh        VERIFY=1 adds B = 16, 32, 64
source "$(dirname "$0")/device_env.sh"
rc=0
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
timeout "${T_tests:-240}" python3 -m pytest -q -m gpu tests/test_kernels_moe_mxfp4_v4.py 2>&1 | tee "$OUT/pytest-v4.log" | tail -15 || rc=1
v=""; [ -n "${VERIFY:-}" ] && v="--verify"
timeout "${T_bench:-300}" python3 -m peregrine.bench.kernels_moe_mxfp4 --v4 $v --results-dir results 2>&1 \
  | tee "$OUT/bench-v4.log" | grep -v "^{" | tail -30 || rc=1
cp results/*kernels-moe-mxfp4*.json "$OUT/" 2>/dev/null
exit $rc
