"""Which KDA prefill path a short row should take on the GPU: one KDA layer (the preset's widths, BF16)
prefilling one row of T tokens, through the one-kernel recurrence (kernels/kda.py, serial in T) or fla's
chunked kernels; the crossover sets models/kda.py's SHORT_ROW_MAX_TOKENS.

Per T: the layer's wall time per call (host + GPU, synchronised: what a host-bound prefill step pays),
and the recurrence kernel alone in a CUDA graph with its GB/s (FP32 state read + written, conv window,
the row's inputs and output; the layer's small weights not counted) against the copy bandwidth measured in the same run.
    python -m peregrine.bench.kda_rows --model kimi-linear-48b-a3b
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .gpu import copy_bandwidth, graph_time, result_path, run_metadata, write_result

LENGTHS = (8, 16, 32, 64, 128, 256, 512)
ITERS = 30


def wall_ms(fn, iters: int = ITERS) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv=None) -> int:
    from ..cache import ModelCache
    from ..config import resolve_model
    from ..decode.batch import StepInput
    from ..kernels.kda import kda_decode
    from ..models import kda as K
    ap = argparse.ArgumentParser(prog="python -m peregrine.bench.kda_rows", description=__doc__)
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or K.fla_ops() is None:
        raise SystemExit("needs a GPU and fla-core")
    cfg, _ = resolve_model(a.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = K.KDA(cfg, cfg.kda_layers[0], torch.bfloat16)
        for n, p in layer.named_parameters():
            p.data = (torch.randn_like(p.float()) * (0.5 if n in ("A_log", "dt_bias", "conv_w") else 0.02)).to(p.dtype)
        layer.o_norm.data += 1
    cache = ModelCache(cfg, num_blocks=2, block_size=64, num_slots=2, dtype=torch.bfloat16, device="cuda")
    H, d, W1 = layer.H, layer.d, cfg.kda_conv_size - 1
    bw = copy_bandwidth()
    print(f"{a.model}: KDA layer H={H} d={d}; copy bandwidth {bw['gbps']:.0f} GB/s")
    rows = []
    for T in (int(t) for t in a.lengths.split(",")):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        step = StepInput.build([(list(range(T)), 64, 0, [0] * (T // 64 + 3))], 64, "cuda")
        res = {"T": T}
        limit = K.SHORT_ROW_MAX_TOKENS
        for name, short in (("kernel", True), ("fla", False)):
            K.SHORT_ROWS_KERNEL, K.SHORT_ROW_MAX_TOKENS = short, max(T, limit)
            try:
                res[f"{name}_wall_ms"] = wall_ms(lambda: layer(x, step, cache))
            finally:
                K.SHORT_ROWS_KERNEL, K.SHORT_ROW_MAX_TOKENS = None, limit
        qkv, f, b, r = layer.project(x)
        out = torch.empty(1, T, H * d, dtype=torch.bfloat16, device="cuda")
        slot = torch.zeros(1, dtype=torch.int32, device="cuda")
        kl = cache.kda_index[layer.layer]
        ms, samples = graph_time([lambda: kda_decode(qkv[None], f[None], b[None], r[None], layer.conv_w, layer.A_log,
                                                     layer.dt_bias, layer.o_norm, cache.state[kl], cache.conv[kl], slot,
                                                     eps_o=cfg.rms_norm_eps, out=out)] * 10)
        nbytes = 2 * H * d * d * 4 + 2 * W1 * 3 * H * d * 2 + T * (3 * H * d + 3 * H * d + H) * 2
        res.update(kernel_ms=ms, kernel_samples_ms=samples, bytes=nbytes, gbps=nbytes / (ms * 1e-3) / 1e9)
        res["pct_copy_bw"] = 100 * res["gbps"] / bw["gbps"]
        kw, fw = statistics.median(res["kernel_wall_ms"]), statistics.median(res["fla_wall_ms"])
        print(f"T={T:4d}  layer wall: kernel {kw:6.3f} ms, fla {fw:6.3f} ms ({fw / kw:4.2f}x);"
              f"  kernel alone {ms * 1e3:7.1f} us, {res['gbps']:6.0f} GB/s ({res['pct_copy_bw']:4.1f} % of copy)")
        rows.append(res)
    path = write_result(result_path(a.model, "kda-rows", a.results_dir),
                        {"meta": run_metadata(), "copy_bandwidth": bw, "short_row_max_tokens": K.SHORT_ROW_MAX_TOKENS,
                         "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
