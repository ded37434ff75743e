#!/usr/bin/env bash
# Issue #46 point 1 on one H100/H200 (~6 min): the persistent KDA + MoE layer against today's chain for the same
# layer, one machine. The chain's layer: bench decode at the 48B's widths with one and with two KDA + MoE layers
# (no MLA); the difference of their graph replays per B is one layer inside the specialized step. The persistent
# layer: bench kernels_cute's libraries (.cute/ from scripts/build_cute_gpu.sh, built on the CPU machine first).
#   run (carry .commit, .whl and .cute):  bash scripts/gpu_persistent_layer.sh
source "$(dirname "$0")/device_env.sh"
rc=0
for n in 1 2; do
  d=/tmp/kda48-$n; mkdir -p $d
  python3 -c "import json,sys; r=json.load(open('peregrine/presets/kimi-linear-48b-a3b.json')); n=int(sys.argv[2])
r.update(num_hidden_layers=n, first_k_dense_replace=0); r['linear_attn_config'].update(kda_layers=list(range(1, n + 1)), full_attn_layers=[])
json.dump(r, open(sys.argv[1] + '/config.json', 'w'))" $d $n
  timeout "${T_decode:-150}" python3 -m peregrine bench decode --model $d --dummy-weights --batch-sizes ${BATCHES:-1,2,4,8} \
    --input-len 1 --output-len 64 --prompt-sets 1 --runs 2 --backends latency_specialized \
    --results-dir results/persistent-chain-$n 2>&1 | tee "$OUT/decode-$n.log" | grep -v captur | tail -6 || rc=1
done
timeout "${T_cute:-300}" python3 -m peregrine.bench.kernels_cute --chain results/persistent-chain-1 results/persistent-chain-2 \
  2>&1 | tee "$OUT/cute.log" | grep -v "^\s*$" | tail -20 || rc=1
tar czf "$OUT/results-persistent.tgz" $(ls results/*kernels-cute*.json results/persistent-chain-*/* 2>/dev/null)
exit $rc
