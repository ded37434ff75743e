#!/usr/bin/env bash
# The head check (issue #57), first in any session that is lent a device; at most 9 minutes on one H100 or H200:
# 1. decode: `bench decode` on the 48B (dummy weights), latency_specialized, B = 1, 2, 4, 8: greedy, sampled
#    (temperature 0.6, top-p 0.95) and sampled with logprobs 5, all on one engine (same-run ratios)
# 2. spec: `bench spec` synthetic acceptance (vLLM's "synthetic" method) 1.5, 3.78 and 6.0, k = 7, B = 1 and 8,
#    width auto, against plain on the same engine; greedy, then sampled rows (0.6 / 0.95: rejection sampling)
# 3. kernels: the sampler's and the step logprobs' launches on flat and peaked rows (kernels_sampling --quick, ~45 s):
#    what a sampled step's cost over greedy is made of
# 4. tests: every `-m gpu` test of the kernels, the fast step and the sampler, in the time left
# Then one table: each target, the figure, met or short (python -m peregrine.bench.check).
# An H200 runs the BF16 48B; an H100 (80 GB: the BF16 48B does not fit) the 48B with MXFP4 experts.
# JSON (with GPU, commit, same-run copy bandwidth) under results/check/ and in $OUT/check-results.tgz.
#   run (carry .commit):  bash scripts/gpu_check.sh      PARTS (default "decode spec kernels tests"), BUDGET_S (530)
source "$(dirname "$0")/device_env.sh"
start=$(date +%s); budget=${BUDGET_S:-530}
left() { echo $(( budget - ($(date +%s) - start) )); }
R=results/check; rm -rf "$R"; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "commit ${PEREGRINE_COMMIT:-unknown}" | tee -a "$OUT/gpu.txt"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
M=kimi-linear-48b-a3b
if [ "${mib:-0}" -lt 100000 ]; then  # the BF16 48B needs more than 80 GB: its experts in MXFP4 (K3's format)
  M=/tmp/kimi-linear-48b-a3b-mxfp4; mkdir -p $M
  python3 -c "import json; d = json.load(open('peregrine/presets/kimi-linear-48b-a3b.json'))
d['quantization_config'] = {'format': 'mxfp4-pack-quantized', 'quant_method': 'compressed-tensors'}
json.dump(d, open('$M/config.json', 'w'), indent=1)"
fi
echo "model $M" | tee -a "$OUT/gpu.txt"
TESTS="tests/test_kernels_*.py tests/test_specialized.py tests/test_k3_specialized.py tests/test_spec_specialized.py
  tests/test_pdl.py"
TO=""; python3 -c "import pytest_timeout" 2>/dev/null && TO="--timeout=120"
rc=0
for p in ${PARTS:-decode spec kernels tests}; do
  echo "=== $p ($(date -u +%T), $(left) s left)"
  case $p in
    decode)
      timeout "${T_decode:-150}" python3 -m peregrine bench decode --model $M --dummy-weights \
        --backends latency_specialized --batch-sizes 1,2,4,8 --input-len 1 --output-len 256 --prompt-sets 1 --runs 2 \
        --temperature 0.6 --top-p 0.95 --also-logprobs 5 --results-dir $R 2>&1 \
        | tee "$OUT/decode.log" | grep -E "B=|copy bandwidth|WARN|Error|error" | grep -v captur || rc=1 ;;
    spec)
      timeout "${T_spec:-260}" python3 -m peregrine bench spec --model $M --dummy-weights --batch-sizes 1,8 --k 7 \
        --input-len 256 --output-len 128 --no-oracle --acceptance-lengths 1.5,3.78,6 --widths auto \
        --temperature 0.6 --top-p 0.95 --results-dir $R 2>&1 \
        | tee "$OUT/spec.log" | grep -E "B=|WARN|Error|error|table" | grep -v captur || rc=1 ;;
    kernels)
      timeout "${T_kernels:-90}" python3 -m peregrine.bench.kernels_sampling --quick --results-dir $R > "$OUT/kernels.log" 2>&1 \
        || rc=1; grep -E "copy|argmax|logprobs|top_p" "$OUT/kernels.log" | cut -c1-400 ;;
    tests)
      t=$(( $(left) - 10 )); [ $t -lt 30 ] && { echo "tests skipped: $t s left"; continue; }
      # one process (each file's own would cost ~5 s of imports); -v prints each verdict as it comes
      timeout $t python3 -m pytest -m gpu -v $TO --tb=short -p no:cacheprovider -rf $TESTS > "$OUT/pytest-gpu.log" 2>&1
      trc=$?; [ $trc = 124 ] && echo "pytest cut at $t s" | tee -a "$OUT/pytest-gpu.log"
      [ $trc != 0 ] && rc=1
      grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pytest-gpu.log" | tail -25 ;;
    *) echo "unknown part $p (decode spec kernels tests)"; rc=1 ;;
  esac
done
tar czf "$OUT/check-results.tgz" $R
echo "=== verdict ($(( $(date +%s) - start )) s)"
python3 -m peregrine.bench.check $R --out "$OUT/check.json" || rc=1
exit $rc
