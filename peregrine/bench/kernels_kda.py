"""KDA one-kernel decode microbenchmark (BENCHMARKS.md §2): Kimi-Linear shapes, T = 1.

Each case is a CUDA graph of REPS calls rotating over disjoint state/conv copies (laid out
like the real cache, [copy, slot, ...]), so the FP32 state streams from HBM, not L2.
Bytes = state read + write (FP32) + conv state read + write + qkv|f|b|r inputs + output
+ the layer's small weights + slot ids. fla's fused_recurrent_kda (recurrence only: no conv,
no norms, no output gate, so it moves fewer bytes) is timed the same way when installed.
    python -m peregrine.bench.kernels_kda [--quick] [--tune]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from peregrine.kernels.kda import kda_decode, kda_decode_ref

H, D, W = 32, 128, 4            # Kimi-Linear KDA heads, head dim, conv width
BATCHES = (1, 2, 4, 8)
T = 1                           # plain decode; speculative T > 1 is the same kernel
SLOTS = 16                      # cache slots per copy; the batch uses a shuffled subset
L2_BYTES = 60 << 20
ROTATE_BYTES = 3 * L2_BYTES     # rotation working set that cannot stay in L2
MAX_COPIES = 64
REPS = 20                       # calls per graph replay: amortises the replay launch
DTYPE = torch.bfloat16
TUNE_WARPS = (4, 8, 16)


class Case:
    def __init__(self, batch: int, dev: str = "cuda"):
        C, HD = 3 * H * D, H * D
        per = batch * (H * D * D * 4 + (W - 1) * C * DTYPE.itemsize)
        self.copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // per)))
        self.state = torch.randn(self.copies, SLOTS, H, D, D, device=dev) * 0.1
        self.conv = torch.randn(self.copies, SLOTS, W - 1, C, device=dev, dtype=DTYPE)
        self.slots = torch.randperm(SLOTS, device=dev)[:batch].contiguous()
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(DTYPE)  # noqa: E731
        self.inp = dict(qkv=rnd(batch, T, C), f=rnd(batch, T, HD), b=rnd(batch, T, H), r=rnd(batch, T, HD),
                        conv_w=rnd(C, W, scale=0.5), A_log=torch.rand(H, device=dev) * 2.7,
                        dt_bias=rnd(HD, scale=0.5), o_norm_w=rnd(D, scale=0.1) + 1)
        self.out = torch.empty(batch, T, HD, device=dev, dtype=DTYPE)
        io = batch * T * (C + HD + H + HD + HD) * DTYPE.itemsize
        weights = (C * W + HD + D) * DTYPE.itemsize + H * 4
        self.bytes = 2 * per + io + weights + batch * 8
        self.batch = batch

    def call(self, i, **kw):
        return kda_decode(**self.inp, state=self.state[i], conv_state=self.conv[i], slots=self.slots,
                          out=self.out, **kw)

    def rel_err(self, **kw) -> float:
        st, cv = self.state[0].clone(), self.conv[0].clone()
        ref = kda_decode_ref(**self.inp, state=st, conv_state=cv, slots=self.slots).float()
        self.call(0, **kw)
        s = self.slots
        e_o = ((self.out.float() - ref).norm() / ref.norm()).item()
        e_s = ((self.state[0][s] - st[s]).norm() / st[s].norm()).item()
        return max(e_o, e_s)


def graph_time(fn_of_i, copies: int, iters: int) -> tuple[float, list[float]]:
    """Median ms per call of a CUDA graph holding REPS calls over rotating copies."""
    from peregrine.bench.gpu import time_fn
    seq = [i % copies for i in range(REPS)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in seq[:3]:  # compile + allocator warm-up outside capture
            fn_of_i(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in seq:
            fn_of_i(i)
    samples = [t / REPS for t in time_fn(g.replay, iters=iters, warmup=3)]
    del g
    return statistics.median(samples), samples


def fla_time(case: Case, iters: int):
    """fla's fused_recurrent_kda on the same shapes, or a string saying why not."""
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception:
        return "fla not installed"
    try:
        B, HD = case.batch, H * D
        q, k, v = (x.view(B, T, H, D) for x in case.inp["qkv"].split(HD, -1))
        g = -torch.rand(B, T, H, D, device="cuda")  # log decay, FP32
        beta = torch.rand(B, T, H, device="cuda", dtype=DTYPE)
        h0 = [case.state[i, :B].contiguous() for i in range(case.copies)]

        def fn(i):
            return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0[i], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        return graph_time(fn, case.copies, iters)[0]
    except Exception as e:  # noqa: BLE001 - an API drift in fla must not hide our numbers
        return f"fla failed: {type(e).__name__}: {e}"[:200]


def run(copy_gbps: float, full: bool = True, tune: bool = False, iters: int = 30) -> list[dict]:
    rows = []
    for batch in BATCHES if full else (1, 8):
        n_before = len(rows)
        case = Case(batch)
        err = case.rel_err()
        t, samples = graph_time(case.call, case.copies, iters)
        fla = fla_time(case, iters)
        gbps = case.bytes / t / 1e6
        row = {"kernel": "kda_decode", "shape": f"B={batch} T={T} H={H} d={D}", "B": batch, "T": T,
               "time_ms": t, "bytes": case.bytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
               "rel_err": err, "samples_ms": samples}
        row |= {"fla_ms": fla} if isinstance(fla, float) else {"fla": fla}
        rows.append(row)
        if tune:
            for nw in TUNE_WARPS:
                tt, ss = graph_time(lambda i: case.call(i, num_warps=nw), case.copies, max(10, iters // 3))
                rows.append(row | {"kernel": f"kda_decode[num_warps={nw}]", "time_ms": tt, "samples_ms": ss,
                                   "gbps": case.bytes / tt / 1e6, "pct_of_copy": case.bytes / tt / 1e6 / copy_gbps,
                                   "sweep": True})
        print(table(rows[n_before:], head=n_before == 0), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def table(rows, head: bool = True) -> str:
    lines = [f"{'kernel':<26} {'B':>2} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'err':>8} fla"] if head else []
    for r in rows:
        fla = f"{r['fla_ms']:.4f} ms" if "fla_ms" in r else r.get("fla", "")
        lines.append(f"{r['kernel']:<26} {r['B']:>2} {r['time_ms']:>8.4f} {r['gbps']:>7.0f} "
                     f"{100 * r['pct_of_copy']:>5.1f}% {r['rel_err']:>8.1e} {fla}")
    return "\n".join(lines)


def main():
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B 1 and 8 only")
    ap.add_argument("--tune", action="store_true", help="also sweep num_warps")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    rows = run(copy["gbps"], full=not a.quick, tune=a.tune)
    path = write_result(result_path("kernels", "kda", a.results_dir), {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n-> {path}")


if __name__ == "__main__":
    main()
