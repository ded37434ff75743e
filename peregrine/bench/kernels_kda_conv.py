"""KDA prefill's fused short conv microbenchmark (docs/benchmarks.md §2): kernels/kda_conv.py against the path it
replaces (fla's causal_conv1d after a contiguous copy of the strided q|k|v projections, the q/k/v split
copies and fla's two L2-norm passes) where fla is installed, else the torch form of models/kda.py, at a
1K / 8K / 32K prompt's row of 48B widths (32 heads × 128), timed as CUDA graphs.
    python -m peregrine.bench.kernels_kda_conv
"""
from __future__ import annotations

import torch

from peregrine.bench.gpu import graph_time
from peregrine.kernels.kda_conv import kda_conv

TOKENS = (1024, 8192, 32768)
CANDIDATES = ((32, 4, False), (32, 4, True), (16, 2, True), (64, 4, True), (64, 8, True))  # (BLOCK_T, warps, heads
#   fastest in the grid) timed at every shape; rows say which won
H, D, W = 32, 128, 4
PAD = 288  # the in_proj columns after q|k|v (f_a, g_a, b at 48B widths): x is a strided column slice
DTYPE = torch.bfloat16
DEVICE = "cuda"
EPS = 1e-6


def _baseline():
    """The replaced path as a callable (x, win, w) -> (q, k, v), and its name."""
    from peregrine.models import kda as K
    ops = K.fla_ops()
    if ops is not None:
        from fla.modules.norm.l2norm import l2norm_fwd

        def fla_path(x, win, w):
            init = x.new_zeros(1, x.shape[1], W)
            init[0, :, 1:] = win.T
            y = ops.causal_conv1d(x.contiguous().unsqueeze(0), weight=w, activation="silu", initial_state=init)[0][0]
            q, k, v = (t.contiguous() for t in y.view(1, -1, 3, H, D).unbind(2))
            return l2norm_fwd(q)[0], l2norm_fwd(k)[0], v
        return fla_path, "fla"

    def torch_path(x, win, w):
        y = K.causal_conv(torch.cat([win, x])[None], w)[0].view(-1, 3, H, D)
        return K.l2norm(y[:, 0]).to(x.dtype), K.l2norm(y[:, 1]).to(x.dtype), y[:, 2].to(x.dtype)
    return torch_path, "torch"


def run(copy_gbps: float, full: bool = True, iters: int = 20) -> list[dict]:
    base, base_name = _baseline()
    rows = []
    for T in TOKENS if full else TOKENS[:1]:
        C = 3 * H * D
        x = torch.randn(T, C + PAD, device=DEVICE).to(DTYPE)[:, :C]
        win = torch.randn(W - 1, C, device=DEVICE).to(DTYPE)
        w = (torch.randn(C, W, device=DEVICE) * 0.5).to(DTYPE)
        out = torch.empty(3, T, H, D, device=DEVICE, dtype=DTYPE)
        t, samples = graph_time([lambda: kda_conv(x, win, w, H, EPS, out=out)], iters)
        tb, _ = graph_time([lambda: base(x, win, w)], iters)
        cands = {f"{bt}x{nw}-{'heads' if cm else 'tokens'}-first": graph_time(
                     [lambda bt=bt, nw=nw, cm=cm: kda_conv(x, win, w, H, EPS, out=out, block_t=bt, num_warps=nw, ch_major=cm)],
                     iters)[0] for bt, nw, cm in (CANDIDATES if full else ())}
        nbytes = 2 * T * C * DTYPE.itemsize  # x read, q|k|v written
        gbps = nbytes / t / 1e6
        rows.append({"kernel": "kda_conv", "shape": f"{T} tokens x {H} heads x {D}", "time_ms": t,
                     f"{base_name}_ms": tb, "bytes": nbytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
                     "samples_ms": samples, "candidates_ms": cands,
                     "best": min(cands, key=cands.get) if cands else None})
        del x, out
        torch.cuda.empty_cache()
    return rows


def compile_check() -> list[dict]:
    """The kernel compiled ahead of time for sm_90a in BF16 at 48B widths (no GPU needed): ptxas's registers and spills."""
    from peregrine.bench.kernels_moe import compile_sm90
    from peregrine.kernels import kda_conv as K
    bf, n, c = "*bf16", (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    C = 3 * H * D
    r = compile_sm90(K._kda_conv_kernel, dict(x_ptr=(bf, 0), win_ptr=(bf, 0), w_ptr=(bf, 0), out_ptr=(bf, 0), T=n(8191),
                                              H=n(H), stride_x=n(C + PAD), stride_win=n(C), stride_plane=n(8191 * H * D),
                                              eps=("fp32", EPS), D=c(D), W=c(W), BLOCK_T=c(K.BLOCK_T), BLOCK_D=c(D),
                                              CH_MAJOR=c(K.CH_MAJOR)),
                     K.NUM_WARPS, 1)
    return [{"kernel": "kda_conv"} | r]


def main():
    from peregrine.bench.gpu import family_main
    family_main("kda-conv", run, lambda r: f"{r['kernel']:>9} {r['shape']:>28} {1e3 * r['time_ms']:>9.1f} us (replaced path "
                f"{1e3 * r.get('fla_ms', r.get('torch_ms', float('nan'))):>9.1f} us) {r['gbps']:>7.0f} GB/s "
                f"{100 * r['pct_of_copy']:>5.1f}%; candidates: "
                + " ".join(f"{k} {1e3 * v:.1f}" for k, v in r["candidates_ms"].items()), doc=__doc__)


if __name__ == "__main__":
    main()
