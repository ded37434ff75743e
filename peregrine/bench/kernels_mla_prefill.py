"""MLA prefill attention microbenchmark (docs/benchmarks.md §2): Kimi-Linear dims, BF16, causal.

Shapes are (T, start): T new queries after a cached prefix of `start` tokens (L = start + T).
The kernel is compute-bound, so rows carry TFLOP/s against PEAK_TFLOPS beside the usual GB/s:
FLOPs count only the visible (causal) query-key pairs, 2·H·(Dn + Dr + Dv) per pair; bytes are
q + k_nope + v + k_rope (once, shared by the heads) + out, each read or written once.
In full mode every CONFIG_CANDIDATES tiling is checked and timed per shape and the row reports
the fastest (write the winners into mla_prefill.CONFIGS); quick mode times the default only.
Baseline, same run: torch SDPA on the same problem (k_rope expanded to every head and
concatenated, v padded to 192 for the flash backend; those copies are not timed), every
backend that accepts it, the fastest reported as torch_ms with its name.
    python -m peregrine.bench.kernels_mla_prefill [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from peregrine.kernels import mla_prefill as mp

DIMS = (32, 128, 64, 128)    # Kimi-Linear MLA: H, Dn, Dr, Dv
LAT = 576                    # latent row (kv_lora 512 + rope 64): k_rope is a view of its last 64
SM_SCALE = (DIMS[1] + DIMS[2]) ** -0.5
DTYPE = torch.bfloat16
PEAK_TFLOPS = 790.0          # H200 measured ~790 TFLOP/s dense BF16 matmul (device KINDS notes)
TOL = 1e-2                   # docs/correctness.md: BF16 operands vs the FP32 reference
CHECK_ROWS = 128             # validation: the reference on the first, a middle and the last rows only
SHAPES = ((1024, 0), (8192, 0), (16384, 0), (32768, 0),  # first chunk, T = L
          (8192, 8192), (8192, 24576), (2048, 30720),  # later chunks of a chunked prefill
          (64, 32704))                                  # turn-2 prefix hit: few queries, long prefix
QUICK_SHAPES = ((8192, 0), (8192, 24576), (64, 32704))
ITERS, WARMUP = 10, 2        # a 32K causal call is ~10 TFLOP: tens of ms each
ROUTE_FRESH_OFFSET = 8       # the route's first-call timing uses T - 8 queries: a shape cuDNN has not planned
SPLIT_CANDIDATES = (1, 2, 4, 8, 16)  # KV splits tried with the default tiling where it would split


def visible_pairs(T: int, start: int) -> int:
    """Σ_t (start + t + 1): query t sees keys 0 … start + t."""
    return T * start + T * (T + 1) // 2


def flops(T: int, start: int) -> int:
    H, Dn, Dr, Dv = DIMS
    return 2 * H * (Dn + Dr + Dv) * visible_pairs(T, start)


def io_bytes(T: int, start: int) -> int:
    H, Dn, Dr, Dv = DIMS
    L = start + T
    return DTYPE.itemsize * (T * H * (Dn + Dr) + L * (H * (Dn + Dv) + Dr) + T * H * Dv)


def shapes(full: bool = True):
    return list(SHAPES if full else QUICK_SHAPES)


class Case:
    """One sequence's prefill inputs, laid out as the model passes them (strided views)."""

    def __init__(self, T: int, start: int, device="cuda", seed: int = 0):
        H, Dn, Dr, Dv = DIMS
        g = torch.Generator(device=device).manual_seed(seed)
        self.T, self.start, self.L = T, start, start + T
        self.kv = torch.randn(self.L, H, Dn + Dv, device=device, dtype=DTYPE, generator=g)
        self.lat = torch.randn(self.L, LAT, device=device, dtype=DTYPE, generator=g)
        self.q = torch.randn(T, H, Dn + Dr, device=device, dtype=DTYPE, generator=g)
        self.kn, self.v, self.kr = self.kv[..., :Dn], self.kv[..., Dn:], self.lat[:, LAT - Dr:]
        self.out = torch.empty(T, H, Dv, device=device, dtype=DTYPE)

    def call(self, config=None):
        return mp.mla_prefill(self.q, self.kn, self.kr, self.v, SM_SCALE, start=self.start, out=self.out,
                              config=config)

    def rel_err(self, config=None) -> float:
        """Worst relative error over three row slices (first, middle, last CHECK_ROWS queries), each
        checked against the reference on exactly the keys those rows may see."""
        self.call(config)
        worst = 0.0
        for a in sorted({0, max(0, self.T // 2 - CHECK_ROWS // 2), max(0, self.T - CHECK_ROWS)}):
            b = min(self.T, a + CHECK_ROWS)
            n = self.start + b
            ref = mp.mla_prefill_reference(self.q[a:b], self.kn[:n], self.kr[:n], self.v[:n], SM_SCALE,
                                           start=self.start + a)
            got = self.out[a:b].float()
            err = ((got - ref).norm() / ref.norm()).item() if torch.isfinite(got).all() else float("inf")
            worst = max(worst, err)
        return worst

    def time(self, config=None, timer=None) -> tuple[float, list[float]]:
        samples = (timer or _time)(lambda: self.call(config))
        return statistics.median(samples), samples


def _time(fn) -> list[float]:
    from peregrine.bench.gpu import time_fn
    return time_fn(fn, iters=ITERS, warmup=WARMUP)


def sdpa_baseline(case: Case, timer=None) -> dict:
    """torch SDPA over each backend that accepts the problem: {backend: ms or error}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import pad, scaled_dot_product_attention as sdpa

    H, Dn, Dr, Dv = DIMS
    q = case.q.transpose(0, 1).unsqueeze(0)                                     # [1, H, T, 192]
    k = torch.cat([case.kn, case.kr[:, None, :].expand(case.L, H, Dr)], -1).transpose(0, 1).unsqueeze(0)
    v = case.v.transpose(0, 1).unsqueeze(0)
    v192 = pad(v, (0, Dn + Dr - Dv))                                            # flash wants equal head dims
    # T == L: top-left causal is the same mask; later chunks need the diagonal at the bottom right.
    mask = dict(is_causal=True) if case.start == 0 else dict(attn_mask=causal_lower_right(case.T, case.L))
    res = {}
    for name, backend, vv in (("cudnn", SDPBackend.CUDNN_ATTENTION, v), ("flash", SDPBackend.FLASH_ATTENTION, v192),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION, v)):
        def fn(vv=vv, backend=backend):
            with sdpa_kernel(backend):
                return sdpa(q, k, vv, scale=SM_SCALE, **mask)
        try:
            o = fn()[0, :, :, :Dv].transpose(0, 1).float()
            ref = case.out.float()  # the kernel's output from the validation just before
            err = ((o - ref).norm() / ref.norm()).item()
            res[name] = {"time_ms": statistics.median((timer or _time)(fn)), "vs_kernel": err}
        except Exception as e:  # noqa: BLE001 - a backend refusing the shape is a result, not a failure
            res[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    del k, v192
    return res


def route(case: Case, timer=None) -> dict:
    """The model's cold-row route (kernels/mla_prefill_sdpa.py: k assembled, cuDNN, out copied), timed whole;
    and the wall time of its first call at a length not seen before (cuDNN builds a plan per shape)."""
    import time
    from peregrine.kernels import mla_prefill_sdpa as cold
    args = (case.q, case.kn, case.kr, case.v, SM_SCALE)
    try:
        T = case.T - ROUTE_FRESH_OFFSET
        o = torch.empty(T, *case.out.shape[1:], dtype=DTYPE, device=case.q.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cold.attend(case.q[:T], case.kn[:T], case.kr[:T], case.v[:T], SM_SCALE, o)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        samples = (timer or _time)(lambda: cold.attend(*args, case.out))
        ref = case.out.clone()
        case.call()
        err = ((ref.float() - case.out.float()).norm() / case.out.float().norm()).item()
        return {"route_ms": statistics.median(samples), "route_samples_ms": samples, "route_vs_kernel": err,
                "route_first_call_ms": first}
    except Exception as e:  # noqa: BLE001 - a refusing cuDNN is a result
        return {"route_error": f"{type(e).__name__}: {e}"[:300]}


def _stats(T, start, t_ms, copy_gbps) -> dict:
    gbps = io_bytes(T, start) / t_ms / 1e6
    tflops = flops(T, start) / t_ms / 1e9
    return {"time_ms": t_ms, "gbps": gbps, "pct_of_copy": gbps / copy_gbps, "tflops": tflops,
            "pct_of_peak": tflops / PEAK_TFLOPS}


def bench_shape(T: int, start: int, copy_gbps: float, full: bool = True, baseline: bool = True,
                device="cuda", timer=None) -> dict:
    """One shape: check and time the default (full: every candidate) config, then the SDPA baseline.
    device / timer exist for the CPU smoke test (interpreter, fake clock)."""
    case = Case(T, start, device)
    H, Dn, Dr, Dv = DIMS
    default = mp.pick_config(Dn, Dr, Dv, DTYPE, T)
    cands = [default]
    if full:
        cands += [c for c in mp.CONFIG_CANDIDATES if c != default]
        if mp.pick_splits(T, start + T, H, default, device) > 1:
            cands += [dataclasses.replace(default, num_splits=s) for s in SPLIT_CANDIDATES]
    tried = []
    for cfg in cands:
        rec = {"config": vars(cfg).copy(), "splits": mp.pick_splits(T, start + T, H, cfg, device)}
        try:
            err = case.rel_err(cfg)
            rec["rel_err"] = err
            if not err <= TOL:
                rec["error"] = f"wrong result: rel_err {err:.3e} > {TOL}"
            else:
                rec["time_ms"], rec["samples_ms"] = case.time(cfg, timer)
        except Exception as e:  # noqa: BLE001 - out of resources etc.: report, keep going
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        tried.append(rec)
    ok = sorted((r for r in tried if "time_ms" in r), key=lambda r: r["time_ms"])
    row = {"kernel": "mla_prefill", "shape": f"T={T} start={start} L={start + T}", "T": T, "start": start,
           "L": start + T, "H": H, "dims": [Dn, Dr, Dv], "flops": flops(T, start), "bytes": io_bytes(T, start),
           "default_config": vars(default).copy(), "configs": tried}
    if ok:
        best = ok[0]
        row |= _stats(T, start, best["time_ms"], copy_gbps)
        row |= {k: best[k] for k in ("config", "splits", "rel_err", "samples_ms")}
        row["default_ms"] = next((r.get("time_ms") for r in tried if r["config"] == vars(default)), None)
        if baseline:
            case.call(mp.PrefillConfig(**best["config"]))  # SDPA's output is compared with this
            base = sdpa_baseline(case, timer)
            times = {k: b["time_ms"] for k, b in base.items() if "time_ms" in b}
            row["torch_all"] = base
            if times:
                name = min(times, key=times.get)
                row |= {"torch_ms": times[name], "torch_backend": name}
            if start == 0 and device == "cuda":
                row |= route(case, timer)
    else:
        row["error"] = "no config ran correctly"
    del case
    torch.cuda.empty_cache()
    return row


def run(copy_gbps: float, full: bool = True) -> list[dict]:
    if not torch.cuda.is_available():
        raise RuntimeError("the mla_prefill benchmark needs a CUDA GPU")
    rows = []
    print(table([], head=True), flush=True)
    for T, start in shapes(full):
        try:
            row = bench_shape(T, start, copy_gbps, full=full)
        except Exception as e:  # noqa: BLE001 - one failing shape must not hide the rest
            row = {"kernel": "mla_prefill", "shape": f"T={T} start={start} L={start + T}", "T": T, "start": start,
                   "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row | {"family": "mla_prefill"})
        print(table([row], head=False), flush=True)
    return rows


def table(rows, head: bool = True) -> str:
    lines = [f"{'T':>6} {'start':>6} {'ms':>8} {'TFLOP/s':>8} {'%peak':>6} {'GB/s':>6} {'err':>8} "
             f"{'torch ms':>9} {'backend':>9} {'default ms':>10} {'route ms':>8} {'1st ms':>7} "
             f"best config (m/n/warps/stages/splits)"] if head else []
    for r in rows:
        if "time_ms" not in r:
            lines.append(f"{r['T']:>6} {r['start']:>6} FAILED {r.get('error', '')}")
            continue
        c = r["config"]
        tm = f"{r['torch_ms']:>9.3f}" if r.get("torch_ms") is not None else f"{'-':>9}"
        dm = f"{r['default_ms']:>10.3f}" if r.get("default_ms") is not None else f"{'-':>10}"
        rt = f"{r['route_ms']:>8.3f} {r['route_first_call_ms']:>7.1f}" if "route_ms" in r else f"{'-':>8} {'-':>7}"
        lines.append(f"{r['T']:>6} {r['start']:>6} {r['time_ms']:>8.3f} {r['tflops']:>8.1f} "
                     f"{100 * r['pct_of_peak']:>5.1f}% "
                     f"{r['gbps']:>6.0f} {r['rel_err']:>8.1e} {tm} {r.get('torch_backend', '-'):>9} {dm} {rt} "
                     f"{c['block_m']}/{c['block_n']}/{c['num_warps']}/{c['num_stages']}/{r['splits']}")
    return "\n".join(lines)


def compile_check() -> list[dict]:
    """Every candidate and default tiling compiled for sm_90a at the Kimi-Linear dims (no GPU needed),
    the small-T default also in its KV-split form, and the split combine: registers, spills, shared
    memory, wgmma count from ptxas."""
    import triton.language as tl

    H, Dn, Dr, Dv = DIMS
    bf, f32, n, c = "*bf16", "*fp32", (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    jobs = [(cfg, False, False, False) for cfg in dict.fromkeys((*mp.CONFIGS.values(), mp.SMALL_T_CONFIG,
                                                                *mp.CONFIG_CANDIDATES))]
    jobs += [(mp.SMALL_T_CONFIG, True, False, False), (mp.PrefillConfig(), False, True, False),
             (mp.SMALL_T_CONFIG, True, True, False), (mp.FP32_CONFIG, False, False, True)]
    out = []
    for cfg, split, varlen, fp32 in jobs:
        io = f32 if fp32 else bf
        args = dict(q_ptr=(io, 0), kn_ptr=(io, 0), kr_ptr=(io, 0), v_ptr=(io, 0), o_ptr=(io, 0), part_ptr=(f32, 0),
                    lse_ptr=(f32, 0), cu_q_ptr=("*i32", 0), cu_k_ptr=("*i32", 0), st_ptr=("*i32", 0),
                    qk_scale=("fp32", 0.1), T=n(8192), H=n(H), start=n(0), NS=n(4 if split else 1),
                    s_qt=n(H * (Dn + Dr)), s_qh=n(Dn + Dr), s_knl=n(H * (Dn + Dv)),
                    s_knh=n(Dn + Dv), s_krl=n(LAT), s_vl=n(H * (Dn + Dv)), s_vh=n(Dn + Dv), s_ot=n(H * Dv), s_oh=n(Dv),
                    DN=c(Dn), DR=c(Dr), DV=c(Dv), BLOCK_DN=c(mp._pad(Dn)), BLOCK_DR=c(mp._pad(Dr)),
                    BLOCK_DV=c(mp._pad(Dv)), BLOCK_M=c(cfg.block_m), BLOCK_N=c(cfg.block_n),
                    CDT=c(tl.float32 if fp32 else tl.bfloat16), PREC=c("ieee" if fp32 else "tf32"), SPLIT=c(split),
                    VARLEN=c(varlen), HAS_START=c(varlen))
        name = f"{cfg}{' split' if split else ''}{' varlen' if varlen else ''}{' fp32' if fp32 else ''}"
        out.append(_compile(name, mp._mla_prefill_kernel, args, cfg.num_warps, cfg.num_stages))
    args = dict(part_ptr=(f32, 0), lse_ptr=(f32, 0), o_ptr=(bf, 0), T=n(64), H=n(H), S=n(4), s_ot=n(H * Dv),
                s_oh=n(Dv), DV=c(Dv), BLOCK_S=c(mp.MAX_SPLITS), BLOCK_DV=c(mp._pad(Dv)))
    out.append(_compile("combine", mp._combine_kernel, args, mp.COMBINE_WARPS, 1))
    return out


def _compile(name, fn, args, num_warps, num_stages) -> dict:
    from peregrine.bench.kernels_moe import compile_sm90
    try:
        return {"config": name} | compile_sm90(fn, args, num_warps, num_stages)
    except Exception as e:  # noqa: BLE001 - report every failure, not just the first
        return {"config": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}


def main():
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three shapes, the default config only")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    rows = run(copy["gbps"], full=not a.quick)
    path = write_result(result_path("kernels", "mla-prefill", a.results_dir), {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{table(rows)}\n-> {path}")


if __name__ == "__main__":
    main()
