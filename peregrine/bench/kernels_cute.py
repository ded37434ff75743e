"""CuTe DSL kernels on the GPU (issue #46), from the shared libraries scripts/build_cute_gpu.sh builds on a CPU
machine (the GPU machine cannot install the DSL) and a call carries in .cute/: each checked against its FP32
reference, then timed per call with CUDA events against the same bytes through torch (cuBLAS) in the same run, with
the copy bandwidth of that run (docs/benchmarks.md §2).
    python -m peregrine.bench.kernels_cute [--dir .cute] [--results-dir results]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics

import torch

TOL = 1e-2  # relative RMS error against the FP32 reference: BF16 inputs, FP32 accumulation in another order


def weight_stream_rows(lib_dir: str) -> list[dict]:
    from peregrine.kernels.cute import weight_stream as ws
    from peregrine.kernels.cute.launch import CuteLibrary
    from peregrine.bench.gpu import time_fn
    rows = []
    for path in sorted(glob.glob(os.path.join(lib_dir, "libweight_stream-*.so"))):
        N, K = map(int, re.search(r"-(\d+)x(\d+)\.so$", path).group(1, 2))
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16)
        y = torch.full((N,), float("nan"), device="cuda")
        row = {"kernel": "weight_stream", "N": N, "K": K, "bytes": N * K * 2 + K * 2 + N * 4}
        try:
            lib = CuteLibrary(path)
            lib.run(w, x, y)
            torch.cuda.synchronize()
            ref = ws.reference(w, x)
            err = float((y - ref).norm() / ref.norm())
            row["rel_err"] = err
            if not err < TOL:
                raise ValueError(f"relative error {err:.2e} >= {TOL}")
            row["ms"] = statistics.median(time_fn(lambda: lib.run(w, x, y), iters=50))
            row["torch_ms"] = statistics.median(time_fn(lambda: torch.mv(w, x), iters=50))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def main() -> None:
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".cute", help="folder of the built libraries (scripts/build_cute_gpu.sh)")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    rows = weight_stream_rows(a.dir)
    for r in rows:
        for k in ("ms", "torch_ms"):
            if k in r:
                r[k.replace("ms", "gbps")] = r["bytes"] / r[k] / 1e6
                r[k.replace("ms", "pct_of_copy")] = r["bytes"] / r[k] / 1e6 / copy["gbps"]
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    print("wrote", write_result(result_path("cute", "kernels-cute", a.results_dir),
                                {"meta": run_metadata(), "copy": copy, "rows": rows}))


if __name__ == "__main__":
    main()
