"""Fused MoE decode microbenchmark and plan tuner (docs/benchmarks.md §2), Kimi-Linear real shapes.

Router and experts are timed separately, each as a CUDA graph of REPS calls on
REPS different inputs, hence different random routings: the 3.6 GB of expert
weights far exceed the 60 MB L2, so consecutive calls stream their experts from
HBM. Expert bytes = distinct experts actually routed (counted on the host,
outside the timed region) × expert bytes; router bytes = W_r + x. The standard
path (models/moe.py route + grouped_experts, plain PyTorch) is timed on the same
inputs, as a graph too when it captures.

--tune measures every candidate config per B on the same inputs, skips configs
that fail (compile, resources) or disagree with the FP32 reference, groups the
rest by the bits they give a fixed 16-token probe (a token's bits must not depend
on B: one group serves all B), picks the group with the least total time and its
fastest config per B, re-checks batch invariance, and writes moe_plan.json.
    python -m peregrine.bench.kernels_moe [--quick] [--tune [--dry-run]] [--out PATH]
    python -m peregrine.bench.kernels_moe --compile-check   # any machine: sm_90 compile + ptxas report
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch

from peregrine.bench.gpu import graph_time
from peregrine.kernels import moe

D, I, E, TOP_K, SCALING = 2304, 1024, 256, 8, 2.446  # kimi-linear-48b-a3b MoE layer
BS = (1, 2, 4, 8, 16)
QUICK_BS = (1, 8)
REPS = 16         # calls (= routing sets) per graph replay: amortises the replay launch, rotates experts
DTYPE = torch.bfloat16
DEVICE = "cuda"   # a module constant so the tuning logic can be smoke-tested on CPU (interpreter)
TUNE_ITERS = 8    # replays per candidate while tuning (each replay is REPS calls)
TUNE_BUDGET_S = 170  # stop timing new candidates past this (the whole tune should stay under ~3 min)
EXPERT_TOL, LOGIT_TOL = 1e-2, 1e-5  # relative RMSE vs the FP32/FP64 references (BF16 h; FP32 router)
SHARED = False    # --shared: time and tune the experts with the shared expert as slot k (the decode path's form)

# Candidates. Compile count, not run time, bounds the sweep (~45 compiles in all).
ROUTER_CANDS = [moe.DEFAULT_ROUTER] + [
    {"variant": v, "BLOCK_E": be, "BLOCK_K": bk, "CHUNK": ch, "num_warps": w, "num_stages": 2}
    for v, be, bk, ch, w in [("dot", 16, 256, 256, 4), ("dot", 32, 128, 256, 4), ("dot", 16, 64, 128, 4),
                             ("dot", 16, 128, 128, 4), ("dot", 32, 64, 128, 4), ("dot", 16, 128, 512, 4),
                             ("dot", 32, 256, 512, 8), ("fma", 8, 256, 256, 4), ("fma", 4, 256, 256, 4),
                             ("fma", 16, 128, 128, 4), ("fma", 8, 128, 128, 2),
                             # one warp: moe_route then does the top-k in the same launch (fuses_topk)
                             ("fma", 8, 256, 256, 1), ("fma", 4, 256, 256, 1), ("fma", 8, 128, 128, 1),
                             ("dot", 16, 128, 256, 1), ("dot", 16, 64, 128, 1)]]
UP_CANDS = [dict(zip(("UP_BLOCK_I", "UP_BLOCK_D", "up_warps", "up_stages"), v)) for v in
            [(32, 256, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 256, 8, 3), (16, 512, 4, 3), (32, 512, 4, 2),
             (16, 256, 4, 4)]]
DOWN_CANDS = [dict(zip(("DOWN_BLOCK_D", "DOWN_BLOCK_I", "SWAP", "down_warps", "down_stages"), v)) for v in
              [(32, 256, False, 4, 3), (64, 256, False, 4, 3), (128, 128, False, 4, 3), (128, 128, False, 8, 3),
               (32, 128, False, 4, 4), (16, 256, False, 4, 3), (64, 128, False, 4, 4), (64, 128, True, 4, 3),
               (128, 128, True, 4, 3), (64, 256, True, 4, 3), (128, 64, True, 4, 4), (32, 512, False, 4, 2),
               (16, 1024, False, 4, 1)]]
FUSED_CANDS = [dict(zip(("variant", "BLOCK_I", "BLOCK_D", "BLOCK_DO", "num_warps", "num_stages"), ("fused",) + v))
               for v in [(32, 256, 128, 4, 3), (32, 256, 256, 4, 3), (32, 128, 128, 4, 4), (64, 128, 128, 4, 3),
                         (64, 256, 64, 8, 2), (16, 256, 256, 4, 3)]]


# ----------------------------------------------------------------------------- inputs
class Weights:
    """One MoE layer's weights, shared by every B (so B changes only the inputs)."""

    def __init__(self, dtype=None, seed=0):
        dtype = dtype or DTYPE
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        r = lambda *s, scale: (torch.randn(*s, device=DEVICE, generator=g) * scale).to(dtype)  # noqa: E731
        self.w13 = r(E, 2 * I, D, scale=D ** -0.5)
        self.w2 = r(E, D, I, scale=I ** -0.5)
        self.gate_w = r(E, D, scale=D ** -0.5)
        self.bias = torch.randn(E, device=DEVICE, generator=g) * 0.02
        self.s13, self.s2 = r(2 * I, D, scale=D ** -0.5), r(D, I, scale=I ** -0.5)  # the shared expert
        self.dtype = dtype
        self.esz = torch.finfo(dtype).bits // 8


def experts(w: Weights, x, ids, tw, cfg, out):
    """The expert launches + combine into out; ids/tw carry slot k = the shared expert under SHARED."""
    part = moe.moe_expert_partials(x, w.w13, w.w2, ids, config=cfg, shared=(w.s13, w.s2) if SHARED else None)
    return moe.moe_combine(part, tw, out=out, dtype=x.dtype)


def experts_ref(w: Weights, x, ids, tw):
    """FP32 reference; under SHARED the last slot's id E is the shared expert, stacked as expert E."""
    if not SHARED:
        return moe.moe_experts_ref(x, w.w13, w.w2, ids, tw)
    return moe.moe_experts_ref(x, torch.cat([w.w13, w.s13[None]]), torch.cat([w.w2, w.s2[None]]), ids, tw)


def with_shared(ids, tw):
    """[B, k] routing -> [B, k + 1] with the shared slot (id E, weight 1), as router_topk's shared_slot."""
    B = ids.shape[0]
    return (torch.cat([ids, torch.full((B, 1), E, dtype=ids.dtype, device=ids.device)], 1).contiguous(),
            torch.cat([tw, torch.ones(B, 1, dtype=tw.dtype, device=tw.device)], 1).contiguous())


class Case:
    """REPS inputs of B tokens and their routings (from our router with the default config)."""

    def __init__(self, wts: Weights, B: int):
        g = torch.Generator(device=DEVICE).manual_seed(1000 + B)
        self.w, self.B = wts, B
        self.xs = [torch.randn(B, D, device=DEVICE, generator=g).to(wts.dtype) for _ in range(REPS)]
        self.routes = [moe.moe_route(x, wts.gate_w, wts.bias, TOP_K, True, SCALING, config=moe.DEFAULT_ROUTER,
                                     shared_slot=SHARED) for x in self.xs]
        self.distinct = statistics.mean(ids.unique().numel() for ids, _ in self.routes)  # the shared one counts
        self.out = torch.empty(B, D, device=DEVICE, dtype=wts.dtype)
        self.expert_bytes = self.distinct * 3 * I * D * wts.esz + 2 * B * D * wts.esz
        self.router_bytes = E * D * wts.gate_w.element_size() + B * D * wts.esz

    def time_router(self, cfg, iters, fused: bool = True):
        """fused: moe_route (one launch where fuses_topk, a one-warp config); False: the logits and top-k
        launches (router_partials, router_topk: moe_route's form for the other configs)."""
        if fused:
            return graph_time([lambda x=x: moe.moe_route(x, self.w.gate_w, self.w.bias, TOP_K, True, SCALING,
                                                         config=cfg) for x in self.xs], iters)
        return graph_time([lambda x=x: moe.router_topk(moe.router_partials(x, self.w.gate_w, config=cfg).unsqueeze(0),
                                                       self.w.bias, TOP_K, True, SCALING) for x in self.xs], iters)

    def time_experts(self, cfg, iters):
        return graph_time([lambda x=x, r=r: experts(self.w, x, r[0], r[1], cfg, self.out)
                           for x, r in zip(self.xs, self.routes)], iters)

    def time_standard(self, iters):
        """(router ms, experts ms) of the standard path: graph replay if it captures, else eager."""
        from peregrine.models.layers import swiglu
        from peregrine.models.moe import grouped_experts, route
        std = [route(x, self.w.gate_w, self.w.bias, TOP_K, True, SCALING) for x in self.xs]
        router = [lambda x=x: route(x, self.w.gate_w, self.w.bias, TOP_K, True, SCALING) for x in self.xs]
        experts = [lambda x=x, r=r: grouped_experts(x, self.w.w13, self.w.w2, r[0], r[1], swiglu)
                   for x, r in zip(self.xs, std)]
        return tuple(_graph_or_eager(c, iters) for c in (router, experts))


def _graph_or_eager(calls, iters):
    from peregrine.bench.gpu import time_fn
    try:
        return graph_time(calls, iters)
    except Exception:  # noqa: BLE001 - not capturable on this torch: time it eagerly instead
        torch.cuda.synchronize()
        it = iter(range(1 << 30))
        s = time_fn(lambda: calls[next(it) % len(calls)](), iters=iters * 4, warmup=5)
        return statistics.median(s), s


# ----------------------------------------------------------------------------- benchmark
def run(copy_gbps: float, full: bool = True, iters: int = 30, bs=None, entries: dict | None = None) -> list[dict]:
    """Two rows per B (router, experts): ours with the plan's config (or `entries`'), and the standard path."""
    wts = Weights()
    rows = []
    for B in bs or (BS if full else QUICK_BS):
        case = Case(wts, B)
        rcfg = moe.router_config(E, D, wts.gate_w.dtype, B)
        ecfg = moe.experts_config(E, D, I, TOP_K, wts.dtype, B, shared=SHARED)
        if entries:
            rcfg = moe.pick(entries.get(moe.router_key(E, D, wts.gate_w.dtype)), B, moe.valid_router) or rcfg
            ecfg = moe.pick(entries.get(moe.experts_key(E, D, I, TOP_K, wts.dtype, SHARED)), B, moe.valid_experts) or ecfg
        (tr, sr), (te, se) = case.time_router(rcfg, iters), case.time_experts(ecfg, iters)
        tr2, sr2 = case.time_router(rcfg, iters, fused=False)
        std_r, std_e = case.time_standard(iters)
        shape = f"B={B} D={D} I={I} E={E} k={TOP_K}{'+shared' if SHARED else ''}"
        for kernel, t, s, nbytes, cfg, std in (("moe_router", tr, sr, case.router_bytes, rcfg, std_r),
                                               ("router_2launch", tr2, sr2, case.router_bytes, rcfg, std_r),
                                               ("moe_experts", te, se, case.expert_bytes, ecfg, std_e)):
            gbps = nbytes / t / 1e6
            rows.append({"kernel": kernel, "shape": shape, "B": B, "config": cfg, "order_class": moe.order_class(cfg),
                         "distinct_experts": case.distinct, "bytes": nbytes, "time_ms": t, "gbps": gbps,
                         "pct_of_copy": gbps / copy_gbps, "standard_ms": std[0], "speedup_vs_standard": std[0] / t,
                         "samples_ms": s, "standard_samples_ms": std[1]})
        del case
    torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    out = [f"{'kernel':<12} {'B':>3} {'experts':>7} {'ms':>8} {'GB/s':>6} {'%copy':>6} {'std ms':>8} {'x std':>6}  class"]
    for r in rows:
        out.append(f"{r['kernel']:<12} {r['B']:>3} {r['distinct_experts']:>7.1f} {r['time_ms']:>8.4f} {r['gbps']:>6.0f} "
                   f"{100 * r['pct_of_copy']:>5.1f}% {r['standard_ms']:>8.4f} {r['speedup_vs_standard']:>6.2f}  "
                   f"{r['order_class']}")
    return "\n".join(out)


# ----------------------------------------------------------------------------- tuning
def _digest(t) -> str:
    return hashlib.sha1(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


def _rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Probe:
    """B_MAX tokens, a routing where experts repeat across tokens: every config is grouped by its bits here."""

    def __init__(self, wts: Weights, B: int = moe.B_MAX):
        g = torch.Generator(device=DEVICE).manual_seed(7)
        self.x = torch.randn(B, D, device=DEVICE, generator=g).to(wts.dtype)
        base = torch.randperm(E, device=DEVICE, generator=g)[: 3 * TOP_K]  # few experts: many tokens share each
        self.ids = torch.stack([base[torch.randperm(3 * TOP_K, device=DEVICE, generator=g)[:TOP_K]]
                                for _ in range(B)]).to(torch.int32).contiguous()
        self.tw = torch.rand(B, TOP_K, device=DEVICE, generator=g) + 0.1
        if SHARED:
            self.ids, self.tw = with_shared(self.ids, self.tw)
        self.ref = experts_ref(wts, self.x, self.ids, self.tw)
        self.logits_ref = self.x.double() @ wts.gate_w.double().t()


class Family:
    """How to run, check and time one kernel family's configs (router or experts)."""

    def __init__(self, kind: str, wts: Weights, probe: Probe):
        self.kind, self.w, self.probe = kind, wts, probe
        self.tol = EXPERT_TOL if kind == "experts" else LOGIT_TOL
        self.refs = {}

    def output(self, cfg, x, ids=None, tw=None):
        """Router: FP32 logits; experts: the output (into a NaN-poisoned buffer)."""
        w = self.w
        if self.kind == "router":
            lo = torch.full((x.shape[0], E), float("nan"), device=DEVICE)
            moe.moe_route(x, w.gate_w, w.bias, TOP_K, True, SCALING, config=cfg, logits_out=lo)
            return lo
        out = torch.full((x.shape[0], D), float("nan"), device=DEVICE, dtype=w.dtype)
        return experts(w, x, ids, tw, cfg, out)

    def probe_out(self, cfg, B=moe.B_MAX):
        p = self.probe
        return self.output(cfg, p.x[:B], p.ids[:B].contiguous(), p.tw[:B])

    def probe_ref(self):
        return self.probe.ref if self.kind == "experts" else self.probe.logits_ref

    def check(self, cfg, case) -> float:
        x, (ids, tw) = case.xs[0], case.routes[0]
        if case.B not in self.refs:
            self.refs[case.B] = (experts_ref(self.w, x, ids, tw) if self.kind == "experts"
                                 else x.double() @ self.w.gate_w.double().t())
        return _rel(self.output(cfg, x, ids, tw), self.refs[case.B])

    def time(self, cfg, case) -> float:
        return (case.time_experts if self.kind == "experts" else case.time_router)(cfg, TUNE_ITERS)[0]


def measure(fam: Family, cfg: dict, cases: dict, deadline: float, log=print) -> dict:
    """Probe bits + reference checks + time per B for one config; failures are recorded, never raised."""
    rec = {"config": cfg, "times_ms": {}}
    if time.time() > deadline:
        rec["skipped"] = "tuning time budget spent"
        return rec
    try:
        out = fam.probe_out(cfg)
        rec["probe_rel_err"] = err = _rel(out, fam.probe_ref())
        if not err < fam.tol:
            rec["skipped"] = f"probe disagrees with the reference (rel {err:.2e})"
        else:
            rec["group"] = f"{moe.order_class(cfg)}#{_digest(out)}"
            for B, case in sorted(cases.items()):
                e = fam.check(cfg, case)
                if e < fam.tol:
                    rec["times_ms"][B] = fam.time(cfg, case)
                else:
                    rec.setdefault("wrong_at_B", {})[B] = e
    except Exception as ex:  # noqa: BLE001 - compile failure, out of resources, ...: skip the config
        rec["skipped"] = f"{type(ex).__name__}: {str(ex)[:200]}"
    log(f"{fam.kind:<7} {json.dumps(cfg)} -> " + (rec.get("skipped") or " ".join(
        f"B{B}:{t * 1e3:.1f}us" for B, t in rec["times_ms"].items())))
    return rec


def choose(recs: list, bs) -> tuple[str | None, dict]:
    """The group with the least Σ_B best time among groups with a passing config at every B,
    and its fastest config (index into recs) per B. A token's bits depend only on the group."""
    best = None
    for grp in sorted({r["group"] for r in recs if "group" in r}):
        members = [i for i, r in enumerate(recs) if r.get("group") == grp]
        per_b = {}
        for B in bs:
            timed = [(recs[i]["times_ms"][B], i) for i in members if B in recs[i]["times_ms"]]
            if not timed:
                break
            per_b[B] = min(timed)[1]
        else:
            total = sum(recs[per_b[B]]["times_ms"][B] for B in bs)
            if best is None or total < best[0]:
                best = (total, grp, per_b)
    return (best[1], best[2]) if best else (None, {})


def _single(recs: list, grp: str, bs) -> int | None:
    """The one config of the group timed at every B with the least total (invariance fallback)."""
    full = [i for i, r in enumerate(recs) if r.get("group") == grp and all(B in r["times_ms"] for B in bs)]
    return min(full, key=lambda i: sum(recs[i]["times_ms"][B] for B in bs)) if full else None


def _invariant(fam: Family, recs, per_b: dict, bs) -> bool:
    """Each B's config, run on the probe's first B tokens, must give them the bits of the B_MAX run."""
    full = fam.probe_out(recs[per_b[max(bs)]]["config"])
    return all(torch.equal(fam.probe_out(recs[per_b[B]]["config"], B), full[:B]) for B in bs)


def select(fam: Family, recs: list, bs, log=print) -> dict | None:
    """The plan entry from the measurements, checked for batch invariance."""
    grp, per_b = choose(recs, bs)
    if grp is None:
        log(f"{fam.kind}: no config passed at every B; the plan keeps the default")
        return None
    invariant = "yes" if _invariant(fam, recs, per_b, bs) else None
    if invariant is None:  # a token's bits moved with the config: serve every B with one config
        one = _single(recs, grp, bs)
        if one is not None:
            per_b = {B: one for B in bs}
        invariant = "single config" if one is not None and _invariant(fam, recs, per_b, bs) else "FAILED"
        log(f"WARNING {fam.kind}: per-B configs were not batch invariant; fallback: {invariant}")
    entry = {"order_class": grp, "batch_invariant": invariant, "B": {}}
    for B, i in per_b.items():
        rest = sorted(r["times_ms"][B] for j, r in enumerate(recs) if j != i and B in r["times_ms"])
        entry["B"][str(B)] = recs[i]["config"] | {"measured": {
            "time_ms": recs[i]["times_ms"][B], "best_other_ms": rest[0] if rest else None, "timed": len(rest) + 1}}
    return entry


def _best_overall(recs, bs) -> dict | None:
    full = [r for r in recs if all(B in r["times_ms"] for B in bs)]
    return min(full, key=lambda r: sum(r["times_ms"][B] for B in bs))["config"] if full else None


def tune(copy_gbps: float, bs=BS, budget_s: float = TUNE_BUDGET_S, log=print, router_only: bool = False) -> dict:
    """Router configs, then experts: an up-tile sweep (default down), a down sweep on the best up,
    the fused variant; one choice over everything measured. router_only: the router's entry alone
    (the experts' sweep is most of the time; their entries stay as they are)."""
    t0 = time.time()
    deadline = t0 + budget_s
    wts = Weights()
    probe = Probe(wts)
    cases = {B: Case(wts, B) for B in bs}
    router, experts = Family("router", wts, probe), Family("experts", wts, probe)
    # the router is the same with or without the shared slot: --shared tunes the experts only
    r_recs = [] if SHARED else [measure(router, c, cases, deadline, log) for c in ROUTER_CANDS]
    e_recs = []
    if not router_only:
        e_recs = [measure(experts, moe.DEFAULT_EXPERTS | u, cases, deadline, log) for u in [{}] + UP_CANDS]
        up = _best_overall(e_recs, bs) or moe.DEFAULT_EXPERTS
        e_recs += [measure(experts, c, cases, deadline, log) for c in [up | d for d in DOWN_CANDS] + FUSED_CANDS]
    entries = {}
    families = ((router, r_recs, moe.router_key(E, D, wts.gate_w.dtype)),
                (experts, e_recs, moe.experts_key(E, D, I, TOP_K, wts.dtype, SHARED)))
    for fam, recs, key in families[SHARED:2 - router_only]:
        entry = select(fam, recs, bs, log)
        if entry:
            entries[key] = entry
            log(f"{key}: {entry['order_class']} (batch invariant: {entry['batch_invariant']}) " + " ".join(
                f"B{B}:{c['measured']['time_ms'] * 1e3:.1f}us" for B, c in entry["B"].items()))
    log(f"tuned in {time.time() - t0:.0f} s")
    return {"entries": entries, "records": {"router": r_recs, "experts": e_recs}, "copy_gbps": copy_gbps,
            "tune_s": time.time() - t0}


# ----------------------------------------------------------------------------- offline compile check
SM90 = ("cuda", 90, 32)  # H200 target: Triton compiles for it without a GPU


def compile_sm90(fn, args: dict, num_warps: int, num_stages: int) -> dict:
    """Compile one kernel for sm_90 on any machine (as the JIT would specialise it: pointers and
    ints divisible by 16 hinted) and read ptxas's resource report. args: name -> (type, value)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        ty, v = args.get(name, ("constexpr", False)) if name == "USE_PDL" else args[name]  # PDL: off unless asked
        sig[name] = ty
        if ty == "constexpr":
            consts[name] = v
        elif ty.startswith("*") or (ty == "i32" and v % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget(*SM90)
    opts = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps, "num_stages": num_stages})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                       options=opts.__dict__)
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
        rep = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, rep)) else -1  # noqa: E731
    return {"smem": k.metadata.shared, "regs": num(r"Used (\d+) registers"), "spill": num(r"(\d+) bytes spill stores"),
            "cp_async": ptx.count("cp.async.cg"), "mma": ptx.count("mma.sync"), "wgmma": ptx.count("wgmma.mma_async")}


def compile_check(router_cfgs, expert_cfgs, B: int = 3) -> list[dict]:
    """Every kernel each config launches, compiled for sm_90 at the Kimi-Linear shapes."""
    import triton.language as tl
    bf, f32, i32, c = "*bf16", "*fp32", "*i32", lambda v: ("constexpr", v)
    n = lambda v: ("i32", v)  # noqa: E731
    meta = dict(TOP_K=c(TOP_K), B_PAD=c(moe.B_MAX), K_PAD=c(TOP_K), N_PAD=c(moe.B_MAX * TOP_K),
                DOT_T=c(tl.bfloat16), PREC=c("tf32"), ALIGN=c(moe.MAX_ALIGN))  # the 48B's blocks: multiples of 16
    act = dict(ACT=c(0), BETA=c(moe.SITU_BETA), BETA_L=c(moe.SITU_LINEAR_BETA))
    dims = dict(B=n(B), E=n(E), D=n(D), I=n(I))
    jobs = [("combine", moe._combine_kernel, dict(part_ptr=(f32, 0), tw_ptr=(f32, 0), add_ptr=(bf, 0), out_ptr=(bf, 0),
                                                  B=n(B), D=n(D), NJ=n(1), stride_ob=n(D), stride_ab=n(D), TOP_K=c(TOP_K),
                                                  K_PAD=c(TOP_K), BLOCK_D=c(moe.COMBINE_BLOCK_D), HAS_ADD=c(True)), 4, 2)]
    topk = dict(TOPK_ROWS=c(8), TOP_K=c(TOP_K), K_PAD=c(TOP_K), E_PAD=c(E), RENORM=c(True), HAS_BIAS=c(True),
                STORE_LOGITS=c(False), SHARED=c(True))
    for r in router_cfgs:
        for fused in (False, True):  # moe_route's one launch, and router_partials' logits alone
            jobs.append((f"router{'+topk' if fused else ''} {r}", moe._router_logits_kernel, dict(
                x_ptr=(bf, 0), w_ptr=(bf, 0), part_ptr=(f32, 0), B=n(B), E=n(E), D=n(D), stride_xb=n(D),
                chunk=n(r["CHUNK"]), bias_ptr=(f32, 0), ids_ptr=(i32, 0), tw_ptr=(f32, 0), logits_ptr=(f32, 0),
                count_ptr=(i32, 0), scaling=("fp32", 0), B_PAD=c(moe.B_MAX), BLOCK_E=c(r["BLOCK_E"]),
                BLOCK_K=c(r["BLOCK_K"]), DOT=c(r["variant"] == "dot"), TOPK=c(fused), **topk),
                r["num_warps"], r["num_stages"]))
        jobs.append((f"topk split={-(-D // r['CHUNK'])}", moe._router_topk_kernel, dict(
            part_ptr=(f32, 0), bias_ptr=(f32, 0), ids_ptr=(i32, 0), w_ptr=(f32, 0), logits_ptr=(f32, 0), B=n(B),
            E=n(E), E_SLAB=n(E), scaling=("fp32", 0), SPLIT=c(-(-D // r["CHUNK"])), TOP_K=c(TOP_K), K_PAD=c(TOP_K), E_PAD=c(E),
            RENORM=c(True), HAS_BIAS=c(True), STORE_LOGITS=c(False), SHARED=c(True)),
            moe.TOPK_WARPS, 2))
    for e in expert_cfgs:
        if e["variant"] == "split":
            jobs.append((f"up {e}", moe._expert_up_kernel, dict(
                x_ptr=(bf, 0), w13_ptr=(bf, 0), s13_off=("i64", 0), ids_ptr=(i32, 0), h_ptr=(bf, 0), **dims, stride_xb=n(D),
                BLOCK_I=c(e["UP_BLOCK_I"]), BLOCK_D=c(e["UP_BLOCK_D"]), SHARED=c(True), **act, **meta), e["up_warps"],
            e["up_stages"]))
            jobs.append((f"down {e}", moe._expert_down_kernel, dict(
                h_ptr=(bf, 0), w2_ptr=(bf, 0), s2_off=("i64", 0), ids_ptr=(i32, 0), part_ptr=(f32, 0), **dims,
                BLOCK_D=c(e["DOWN_BLOCK_D"]),
                BLOCK_I=c(e["DOWN_BLOCK_I"]), SWAP=c(bool(e["SWAP"])), **meta),
                e["down_warps"], e["down_stages"]))
        else:
            jobs.append((f"fused {e}", moe._expert_fused_kernel, dict(
                x_ptr=(bf, 0), w13_ptr=(bf, 0), w2_ptr=(bf, 0), s13_off=("i64", 0), s2_off=("i64", 0), ids_ptr=(i32, 0),
                part_ptr=(f32, 0), **dims,
                stride_xb=n(D), BLOCK_I=c(e["BLOCK_I"]), BLOCK_D=c(e["BLOCK_D"]), BLOCK_DO=c(e["BLOCK_DO"]), **act,
                **meta), e["num_warps"], e["num_stages"]))
    out = []
    for name, fn, args, w, st in jobs:
        try:
            out.append({"kernel": name} | compile_sm90(fn, args, w, st))
        except Exception as ex:  # noqa: BLE001 - report every failure, not just the first
            out.append({"kernel": name, "error": f"{type(ex).__name__}: {str(ex)[:500]}"})
    return out


def write_plan(entries: dict, meta: dict, path=moe.PLAN_PATH) -> None:
    old = json.loads(path.read_text()) if path.exists() else {}
    merged = old.get("entries", {}) | entries
    path.write_text(json.dumps({"meta": meta, "entries": merged}, indent=1, sort_keys=True) + "\n")
    moe.clear_plan_cache()


def main() -> None:
    from pathlib import Path

    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B = 1 and 8 only")
    ap.add_argument("--tune", action="store_true", help="sweep configs per B, write the winners to the plan")
    ap.add_argument("--dry-run", action="store_true", help="with --tune: do not write moe_plan.json")
    ap.add_argument("--plan", default=str(moe.PLAN_PATH), help="plan file --tune writes")
    ap.add_argument("--router-only", action="store_true", help="with --tune: the router's entry only (the experts' "
                    "sweep is most of a tune's time)")
    ap.add_argument("--budget-s", type=float, default=TUNE_BUDGET_S, help="stop timing new candidates after this")
    ap.add_argument("--out", default=None, help="result JSON (default results/<date>-<gpu>-...-kernels-moe.json)")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--shared", action="store_true", help="experts with the shared expert as slot k of every token "
                    "(the decode path's launches); --tune then writes the plan's '+shared' entry")
    ap.add_argument("--compile-check", action="store_true", help="no GPU needed: compile every candidate for sm_90, "
                                                                 "print registers / spills / shared memory, exit")
    args = ap.parse_args()
    global SHARED
    SHARED = args.shared
    if args.compile_check:
        rows = compile_check(ROUTER_CANDS, [moe.DEFAULT_EXPERTS | u for u in UP_CANDS] +
                             [moe.DEFAULT_EXPERTS | d for d in DOWN_CANDS] + [moe.DEFAULT_EXPERTS] + FUSED_CANDS)
        for r in rows:
            print(json.dumps(r))
        raise SystemExit(1 if any("error" in r for r in rows) else 0)
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"]}
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s (same run)")
    tuned = None
    if args.tune:
        if args.router_only and SHARED:
            ap.error("--router-only tunes the router, which --shared leaves alone: give one of them")
        tuned = tune(copy["gbps"], BS if not args.quick else QUICK_BS, args.budget_s, router_only=args.router_only)
        if not args.dry_run and tuned["entries"]:
            write_plan(tuned["entries"], {k: meta[k] for k in ("commit", "gpu", "torch", "triton", "time_utc",
                                                                "copy_gbps")}, Path(args.plan))
            if Path(args.plan) != moe.PLAN_PATH:
                moe.PLAN_PATH = Path(args.plan)
                moe.clear_plan_cache()
            print(f"wrote plan {args.plan}")
    entries = tuned["entries"] if tuned and args.dry_run else None  # dry run: time the fresh configs anyway
    rows = run(copy["gbps"], full=not args.quick, entries=entries)
    out = Path(args.out) if args.out else result_path("kimi-linear-48b-a3b", "kernels-moe" + ("-shared" if SHARED else "")
                                                    + ("-tune" if args.tune else ""), args.results_dir)
    path = write_result(out, {"meta": meta, "copy": copy, "tune": tuned, "plan": moe.load_plan(), "rows": rows})
    print(table(rows))
    print("wrote", path)


if __name__ == "__main__":
    main()
