"""MLA decode prologue microbenchmark: the one-launch kernel (kernels/mla_prologue.py) against the
five-op chain it replaces in SpecializedRunner._mla_attend (rms_norm, cat, write_latent, bmm, cat),
at Kimi-Linear-48B's shapes (H 32, nope 128, r 512, rope 64), B 1..8 (16 without --quick), BF16
and FP8 caches.

Each case is a CUDA graph of REPS calls rotating over COPIES layers' kv_b / caches, so W_UK streams
from HBM as in a real step (one layer's 4 MB would otherwise sit in the 60 MB L2). Bytes = W_UK
+ kv_norm + q + kva read, qh + the cache entries (+ FP8 scales) written, slot ids. The fused kernel
is also timed with PDL on (consecutive launches overlap their W_UK prefetch with the previous
one's tail: the best case of the PDL chain the chain's torch ops break).
    python -m peregrine.bench.kernels_mla_prologue [--quick] [--batches 1,2,4,8]
"""
from __future__ import annotations

import argparse
import contextlib

import torch

H, NOPE, R, ROPE, VD = 32, 128, 512, 64, 128   # Kimi-Linear-48B MLA
L = R + ROPE
EPS = 1e-6
BATCHES = (1, 2, 4, 8, 16)
QUICK_BATCHES = (1, 2, 4, 8)
CACHES = ("bf16", "fp8")
PAGE, BLOCKS = 64, 64                          # per-layer cache: 4096 entries
ROTATE_BYTES = 3 * (60 << 20)                  # rotation working set past the H200's L2
REPS = 20                                      # calls per graph replay
DTYPE = torch.bfloat16
QH_TOL = 1e-2                                  # fused vs chain qh, relative (BF16 both)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"B {','.join(map(str, QUICK_BATCHES))} only")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated batch sizes (overrides --quick)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--results-dir", default="results")
    return ap.parse_args(argv)


def case_bytes(batch: int, cache: str) -> int:
    """HBM bytes one call must move (W_UK is read once, whatever B)."""
    e = DTYPE.itemsize
    w = H * NOPE * R * e + R * e
    act = batch * (H * (NOPE + ROPE) + L) * e + batch * H * L * e + batch * 8
    entry = batch * (L * (1 if cache == "fp8" else e) + (4 if cache == "fp8" else 0))
    return w + act + entry


class Case:
    def __init__(self, batch: int, cache: str, dev: str = "cuda"):
        fp8 = cache == "fp8"
        kv_b_bytes = H * (NOPE + VD) * R * DTYPE.itemsize
        self.copies = max(2, -(-ROTATE_BYTES // kv_b_bytes))
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(DTYPE)  # noqa: E731
        self.kv_b = [rnd(H * (NOPE + VD), R, scale=NOPE ** -0.5) for _ in range(self.copies)]
        self.w_uk = [w.view(H, NOPE + VD, R)[:, :NOPE] for w in self.kv_b]
        self.kv_norm = rnd(R, scale=0.1) + 1
        proj = rnd(batch, H * (NOPE + ROPE) + L + 128)  # q | kva | rest, as the in-projection lays them out
        self.q = proj[:, : H * (NOPE + ROPE)].view(batch, H, NOPE + ROPE)
        self.kva = proj[:, H * (NOPE + ROPE): H * (NOPE + ROPE) + L]
        lat_dtype = torch.float8_e4m3fn if fp8 else DTYPE
        self.latent = torch.zeros(self.copies, BLOCKS, PAGE, L, dtype=lat_dtype, device=dev)
        self.scale = torch.ones(self.copies, BLOCKS, PAGE, device=dev) if fp8 else None
        self.slots = torch.randperm(BLOCKS * PAGE, device=dev)[:batch]
        self.batch, self.cache, self.bytes = batch, cache, case_bytes(batch, cache)
        self.qh = torch.empty(batch, H, L, dtype=DTYPE, device=dev)

    def fused(self, i):
        from peregrine.kernels.mla_prologue import mla_prologue
        return mla_prologue(self.q, self.kva, self.w_uk[i], self.kv_norm, EPS, self.latent[i],
                            None if self.scale is None else self.scale[i], self.slots, out=self.qh)

    def chain(self, i):
        """SpecializedRunner._mla_attend's chain, op for op (write_latent inlined on this layer's tensors)."""
        from peregrine.cache import quantize_fp8
        from peregrine.kernels.norm import rms_norm
        entries = torch.cat([rms_norm(self.kva[:, :R], self.kv_norm, EPS), self.kva[:, R:]], -1)
        flat = self.latent[i].view(-1, L)
        if self.scale is not None:
            qv, s = quantize_fp8(entries)
            flat[self.slots] = qv
            self.scale[i].view(-1)[self.slots] = s
        else:
            flat[self.slots] = entries.to(flat.dtype)
        q_lat = torch.bmm(self.q[..., :NOPE].transpose(0, 1), self.w_uk[i]).transpose(0, 1)
        return torch.cat([q_lat, self.q[..., NOPE:]], -1)

    def agreement(self) -> dict:
        """Fused vs chain on copy 0: qh relative error, cache entries bit-equal (fraction), scales equal."""
        lat0 = self.latent[0].clone()
        sc0 = None if self.scale is None else self.scale[0].clone()
        want = self.chain(0).float()
        lat_c = self.latent[0].clone()
        sc_c = None if self.scale is None else self.scale[0].clone()
        self.latent[0].copy_(lat0)
        if sc0 is not None:
            self.scale[0].copy_(sc0)
        got = self.fused(0).float()
        same = (self.latent[0].view(torch.uint8) == lat_c.view(torch.uint8)).float().mean().item()
        out = {"qh_rel_err": ((got - want).norm() / want.norm()).item(), "cache_bytes_equal": same}
        if sc_c is not None:
            out["scales_equal"] = bool(torch.equal(self.scale[0], sc_c))
        return out


def time_case(case: Case, iters: int) -> dict:
    from peregrine.bench.gpu import graph_time
    from peregrine.kernels.pdl import pdl
    seq = [i % case.copies for i in range(REPS)]
    row = {"B": case.batch, "cache": case.cache, "bytes": case.bytes, **case.agreement()}
    for name, fn, ctx in (("chain", case.chain, contextlib.nullcontext), ("fused", case.fused, contextlib.nullcontext),
                          ("fused_pdl", case.fused, lambda: pdl(True))):
        with ctx():
            ms, samples = graph_time([lambda i=i: fn(i) for i in seq], iters=iters)
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_gbps"] = case.bytes / (ms * 1e-3) / 1e9
    row["speedup"] = row["chain_us"] / row["fused_us"]
    return row


def run(copy_gbps: float, batches, iters: int = 30) -> list[dict]:
    rows = []
    for cache in CACHES:
        for b in batches:
            r = time_case(Case(b, cache), iters)
            for name in ("chain", "fused", "fused_pdl"):
                r[f"{name}_pct_of_copy"] = r[f"{name}_gbps"] / copy_gbps
            rows.append(r)
    return rows


def line(r: dict) -> str:
    return (f"{r['cache']:>4} B={r['B']:>2}  chain {r['chain_us']:7.2f} us  fused {r['fused_us']:6.2f} us "
            f"({r['fused_gbps']:5.0f} GB/s, {100 * r['fused_pct_of_copy']:4.1f}% copy)  +pdl {r['fused_pdl_us']:6.2f} us  "
            f"x{r['speedup']:.2f}  qh err {r['qh_rel_err']:.1e}  cache bytes equal {100 * r['cache_bytes_equal']:.2f}%"
            + (f"  scales equal {r['scales_equal']}" if "scales_equal" in r else ""))


def main(argv=None) -> int:
    from peregrine.bench.gpu import copy_bandwidth, kernel_resources, result_path, run_metadata, write_result
    from peregrine.kernels import mla_prologue as mp
    a = parse_args(argv)
    batches = a.batches or (QUICK_BATCHES if a.quick else BATCHES)
    copy = copy_bandwidth()
    rows = run(copy["gbps"], batches, a.iters)
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"],
                             "kernel_resources": kernel_resources(mp._mla_prologue_kernel, 120)}
    path = write_result(result_path("kernels", "mla-prologue", a.results_dir), {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s")
    for r in rows:
        print(line(r))
    print(f"registers/spills: {meta['kernel_resources']}\n-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
