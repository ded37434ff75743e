#!/usr/bin/env bash
# Build the CuTe DSL kernels for the GPU machine, here (a CPU machine): the GPU cannot install the DSL (its CUDA 13
# compiler wheel, 92 MB, is over what a call carries), so each kernel travels as a small shared library in .cute/
# (git-ignored; name it in the device call's carry), linked against the DSL's CUDA 13 launch runtime and loaded
# there by peregrine/kernels/cute/launch.py. A side venv holds the DSL's cu13 flavor; torch and peregrine's other
# dependencies come from .venv (scripts/setup.sh first).
#   bash scripts/build_cute_gpu.sh            then, on the device:  python3 -m peregrine.bench.kernels_cute
set -euo pipefail
cd "$(dirname "$0")/.."
V=${CUTE_VENV:-/tmp/peregrine-cute13}
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/python" -m pip install -q --disable-pip-version-check "nvidia-cutlass-dsl[cu13]==4.8.1"
site=$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD/.venv/lib/python3.11/site-packages" > "$site/zz_peregrine_venv.pth"  # after the DSL's own packages
mkdir -p .cute
CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD "$V/bin/python" - <<'PY'
from peregrine.kernels.cute import aot, weight_stream as ws
assert aot.runtime_archive().split("/")[-3] == "cu13", aot.runtime_archive()
for N, K in ((4096, 2304), (32768, 8192)):  # the 48B o_proj's shape (correctness), and 512 MB (bandwidth)
    print(aot.build_shared(ws.build(), ws.fake_args(N, K) + (132,), 3, f".cute/libweight_stream-{N}x{K}.so"))
# the persistent task kernel over the 48B layer's dense GEMV chain, its MoE block and the whole KDA layer, one
# library per case and B (B + 1 KDA state slots), its shapes beside it
import json, torch
from peregrine.kernels.cute import persistent_layer as tg
from peregrine.persistent import table as tb
for name in ("dense", "moe", "layer"):
    ops, width, _, _, kda = tb.case(name, lambda *s: torch.empty(*s, device="meta"))
    for B in (1, 2, 4, 8):
        shapes = tg.shape_args(tb.encode(ops, width, 132, B), B, kda, B + 1)
        out = f".cute/libpersistent-48b{name}-b{B}.so"
        print(aot.build_shared(tg.build(B, conv=kda[2] if kda else 4), tg.fake_args(**shapes), tg.N_TENSORS, out))
        json.dump({"case": name, **shapes}, open(out[:-3] + ".json", "w"))
PY
