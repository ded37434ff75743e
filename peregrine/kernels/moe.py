"""Fused MoE decode (docs/models.md "MoE layer"): FP32 sigmoid router with top-k,
then the routed experts, each chosen expert's weights read once per step.
No host sync (CUDA-graph capturable).

Router: (1) split-D partial logits, grid (E tiles, D chunks), each
program loads its whole W_r tile at once (the 1-2 MB matrix is latency bound, so
many programs with one big load each); exact FP32 products, either an IEEE dot
(sequential FMA chain) or a token loop over the tile held in registers.
(2) one program per token sums the chunks in a fixed order and picks top-k of
σ(logit) + bias (ties -> lowest expert index, like a stable descending sort).
Unsliced with a one-warp config, (2) is done by the last program of (1) to arrive (an
arrival counter, reset by it): one launch, the same bits.
Tensor parallel with slicing: (1) runs on the rank's E/N experts, the partials are
all-gathered (stacked in rank order) and (2) reads the N slabs as one row of E logits.

Experts: the program of assignment n = (token, slot) exits unless n is the first
occurrence of its expert e in the flat topk_ids; the first one serves EVERY token
that chose e (the padded token tile is one tl.dot operand), so W_e is read once.
  split: up   grid (B·k, I tiles)  h[b, slot] = act(W1 x, W3 x), stored in the weight dtype
         down grid (B·k, D tiles)  part[b, slot] = W2_e h (optionally as W2·hᵀ, "SWAP")
  fused: grid (B·k, I tiles): h tile, then its slice of W2 -> part[I tile, b, slot]
then a combine launch: out[b] = Σ_slot w[b, slot] Σ_itile part (+ add), fixed order.
A shared expert of the routed experts' shape can ride along as slot k of every token (router_topk's
shared_slot writes id E, weight 1; the launches read E's weights from its own tensors): its up
programs need no router output, so they stream its weights before the PDL wait.

Batch invariance: token rows are padded to B_MAX (one compile, one tile shape for
every B ≤ 16) and a tl.dot accumulator chain adds K in order whatever the tile
sizes, so only the variant ("order class") decides a token's bits. The plan
(moe_plan.json, written by `python -m peregrine.bench.kernels_moe --tune`) holds
one order class per shape and, per B, the fastest tiles within it.
"""
from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import torch
import triton
import triton.language as tl

from . import interpreting, read_plan_entries
from .gemm import arrival_counters
from .pdl import launch_kwargs, pdl_wait

PLAN_PATH = Path(__file__).with_name("moe_plan.json")
B_MAX = 16             # decode batches up to 16 share one padded token tile: one compile, batch-invariant bits
MIN_DOT_ROWS = 16      # tl.dot needs M, N, K >= 16
COMBINE_BLOCK_D = 256  # columns per combine program; fixed (never tuned) so its sum order never changes
TOPK_WARPS = 1         # top-k is 3k tiny reductions over E: one warp does each with shuffles, no smem barriers
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # SiTU bounds (docs/models.md)
TANH_EXP_MAX = tl.constexpr(40.0)  # 2/(e^40 + 1) ~ 8e-18: tanh is exactly 1.0 in FP32 well before e^z overflows
ACTIVATIONS = {"swiglu": 0, "situ": 1}
MAX_ALIGN = 16  # elements: the most the expert kernels are told their weight blocks' offsets are multiples of

# Defaults for shapes the plan does not cover. Router: 16 experts x 256 columns (8 KB
# BF16) per program in two loads, ~150 programs for Kimi-Linear. Experts: the up tiles
# measured at ~80 % of copy BW on H200 (2026-11-29); down with 64 x 128 tiles, so each
# program streams 128 KB of W2 in pipelined 16 KB steps (the old 16 x 256 tiles with
# 8 warps ran at ~22 %).
DEFAULT_ROUTER = {"variant": "dot", "BLOCK_E": 16, "BLOCK_K": 128, "CHUNK": 256, "num_warps": 4, "num_stages": 2}
DEFAULT_EXPERTS = {"variant": "split", "UP_BLOCK_I": 32, "UP_BLOCK_D": 256, "up_warps": 4, "up_stages": 3,
                   "DOWN_BLOCK_D": 64, "DOWN_BLOCK_I": 128, "SWAP": False, "down_warps": 4, "down_stages": 3}
ROUTER_INTS = ("BLOCK_E", "BLOCK_K", "CHUNK", "num_warps", "num_stages")
EXPERT_INTS = {"split": ("UP_BLOCK_I", "UP_BLOCK_D", "up_warps", "up_stages", "DOWN_BLOCK_D", "DOWN_BLOCK_I",
                         "down_warps", "down_stages"),
               "fused": ("BLOCK_I", "BLOCK_D", "BLOCK_DO", "num_warps", "num_stages")}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def _token_pad(B: int) -> int:
    return max(B_MAX, _pow2(B))


# ----------------------------------------------------------------------------- plan
@functools.cache
def load_plan(path: str | None = None) -> dict:
    """Plan entries; a missing or unreadable plan is empty (every shape takes the defaults)."""
    return read_plan_entries(Path(path) if path else PLAN_PATH, warn="MoE")


def router_key(E: int, D: int, dtype: torch.dtype) -> str:
    return f"router,{E},{D},{str(dtype).removeprefix('torch.')}"


def experts_key(E: int, D: int, I: int, k: int, dtype: torch.dtype, shared: bool = False) -> str:
    """shared: k routed slots plus the shared expert's (k + 1 assignments a token: its own tiles)."""
    return f"experts,{E},{D},{I},{k}{'+shared' if shared else ''},{str(dtype).removeprefix('torch.')}"


def _is_pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _ints_ok(cfg: dict, fields) -> bool:
    """Tile sizes and warps powers of two; stages any small positive int."""
    return all(isinstance(cfg.get(f), int) and not isinstance(cfg.get(f), bool) and 1 <= cfg[f] <= 8
               if "stages" in f else _is_pow2(cfg.get(f)) for f in fields)


def valid_router(cfg) -> bool:
    return (isinstance(cfg, dict) and cfg.get("variant") in ("dot", "fma")
            and _ints_ok(cfg, ROUTER_INTS) and cfg["CHUNK"] % cfg["BLOCK_K"] == 0
            and (cfg["variant"] == "fma" or (cfg["BLOCK_E"] >= MIN_DOT_ROWS and cfg["BLOCK_K"] >= MIN_DOT_ROWS)))


def valid_experts(cfg) -> bool:
    if not isinstance(cfg, dict) or cfg.get("variant") not in EXPERT_INTS:
        return False
    dims = [f for f in EXPERT_INTS[cfg["variant"]] if "warps" not in f and "stages" not in f]
    return (_ints_ok(cfg, EXPERT_INTS[cfg["variant"]])
            and all(cfg[f] >= MIN_DOT_ROWS for f in dims) and isinstance(cfg.get("SWAP", False), bool))


def pick(entry, B: int, valid) -> dict | None:
    """The entry's config for the smallest tuned batch >= B (else the largest); None if unusable."""
    try:
        per_b = {int(b): c for b, c in entry["B"].items()}
        b = min((v for v in per_b if v >= B), default=max(per_b))
        cfg = {k: v for k, v in per_b[b].items() if k != "measured"}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return cfg if valid(cfg) else None


@functools.lru_cache(maxsize=1024)
def _lookup(kind: str, key: str, B: int) -> tuple:
    entry = load_plan().get(key)
    valid, default = (valid_router, DEFAULT_ROUTER) if kind == "router" else (valid_experts, DEFAULT_EXPERTS)
    cfg = pick(entry, B, valid) if entry is not None else None
    if entry is not None and cfg is None:
        warnings.warn(f"MoE plan entry {key!r} is malformed; using the default config")
    return tuple(sorted((cfg or default).items()))


def router_config(E: int, D: int, dtype: torch.dtype, B: int) -> dict:
    return dict(_lookup("router", router_key(E, D, dtype), B))


def experts_config(E: int, D: int, I: int, k: int, dtype: torch.dtype, B: int, shared: bool = False) -> dict:
    """shared: the shared-slot launches' entry where the plan has one, else the routed-only entry's."""
    key = experts_key(E, D, I, k, dtype, shared)
    if shared and key not in load_plan():
        key = experts_key(E, D, I, k, dtype)
    return dict(_lookup("experts", key, B))


def clear_plan_cache() -> None:
    load_plan.cache_clear()
    _lookup.cache_clear()


# ----------------------------------------------------------------------------- router
@triton.jit
def _router_mac(acc, w, x_ptr, d, d_ok, offs_b, b_ok, B, stride_xb, DOT: tl.constexpr):
    """acc[b, e] += Σ_d x[b, d] · w[e, d] over one [BLOCK_E, BLOCK_K] tile of W_r (FP32)."""
    if DOT:  # exact FP32 FMAs in K order (IEEE, not TF32): the router decides which experts run
        x = tl.load(x_ptr + offs_b[:, None] * stride_xb + d[None, :], mask=b_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:  # token loop over the W tile held in registers
        for b in range(0, B):
            xb = tl.load(x_ptr + b * stride_xb + d, mask=d_ok, other=0.0).to(tl.float32)
            r = tl.sum(w * xb[None, :], axis=1)
            acc = tl.where(offs_b[:, None] == b, acc + r[None, :], acc)
    return acc


@triton.jit
def _topk_rows(logit, bias_ptr, ids_ptr, w_ptr, rows, r_ok, E, scaling, TOP_K: tl.constexpr,
               K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
               SHARED: tl.constexpr):
    """Top-k of [R, E_PAD] FP32 logits (rows `rows` of the outputs). Every step is exact or in a
    fixed order (max/min, one-hot sums, the renorm sum over k in slot order), so the bits do not
    depend on R or on the launch's layout: the fused and the two-launch router agree exactly."""
    offs = tl.arange(0, E_PAD)
    ok = offs < E
    s = tl.sigmoid(logit)
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + offs, mask=ok, other=0.0)[None, :]
    choice = tl.where(ok[None, :], choice, float("-inf"))
    slots = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros([logit.shape[0], K_PAD], tl.int32)
    ws = tl.zeros([logit.shape[0], K_PAD], tl.float32)
    tot = tl.zeros([logit.shape[0]], tl.float32)
    for k in tl.static_range(TOP_K):  # k rounds of argmax; ties -> lowest index
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], offs[None, :], E_PAD), axis=1)
        hit = offs[None, :] == idx[:, None]
        wk = tl.sum(tl.where(hit, s, 0.0), axis=1)
        ids = tl.where(slots == k, idx[:, None], ids)
        ws = tl.where(slots == k, wk[:, None], ws)
        tot += wk
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        ws = ws / tot[:, None]
    K_OUT: tl.constexpr = TOP_K + 1 if SHARED else TOP_K
    out = rows[:, None] * K_OUT + slots
    m = r_ok[:, None] & (slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=m)
    tl.store(w_ptr + out, ws * scaling, mask=m)
    if SHARED:  # one more slot per token: id E (the shared expert), weight 1
        tl.store(ids_ptr + rows * K_OUT + TOP_K, tl.zeros_like(rows) + E, mask=r_ok)
        tl.store(w_ptr + rows * K_OUT + TOP_K, tl.full(rows.shape, 1.0, tl.float32), mask=r_ok)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, B, E, D, stride_xb, chunk,
                          bias_ptr, ids_ptr, tw_ptr, logits_ptr, count_ptr, scaling,
                          B_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                          TOPK: tl.constexpr = False, TOPK_ROWS: tl.constexpr = 1, TOP_K: tl.constexpr = 1,
                          K_PAD: tl.constexpr = 1, E_PAD: tl.constexpr = 1, RENORM: tl.constexpr = False,
                          HAS_BIAS: tl.constexpr = False,
                          STORE_LOGITS: tl.constexpr = False, SHARED: tl.constexpr = False,
                          USE_PDL: tl.constexpr = False):
    s = tl.program_id(1)
    offs_b = tl.arange(0, B_PAD)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    b_ok, e_ok = offs_b < B, offs_e < E
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * D
    acc = tl.zeros([B_PAD, BLOCK_E], tl.float32)
    d_lo = s * chunk
    d_first = d_lo
    if USE_PDL:  # first W_r tile peeled: it loads before the predecessor (which writes x) is done
        d = d_lo + offs_k
        d_ok = d < D
        w = tl.load(w_rows + d[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        pdl_wait(USE_PDL)
        acc = _router_mac(acc, w, x_ptr, d, d_ok, offs_b, b_ok, B, stride_xb, DOT)
        d_first = d_lo + BLOCK_K
    for d0 in range(d_first, tl.minimum(d_lo + chunk, D), BLOCK_K):
        d = d0 + offs_k
        d_ok = d < D
        w = tl.load(w_rows + d[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = _router_mac(acc, w, x_ptr, d, d_ok, offs_b, b_ok, B, stride_xb, DOT)
    tl.store(part_ptr + (s * B + offs_b[:, None]) * E + offs_e[None, :], acc, mask=b_ok[:, None] & e_ok[None, :])
    if TOPK:  # the last program to arrive sums every chunk's partials and picks the experts: no 2nd launch
        tl.debug_barrier()  # every thread's partials are stored before the release below
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.debug_barrier()
            rows = tl.arange(0, TOPK_ROWS)  # next_pow2(B), not B_PAD: no top-k work on padding rows
            r_ok = rows < B
            oe = tl.arange(0, E_PAD)
            m = r_ok[:, None] & (oe < E)[None, :]
            p = part_ptr + rows[:, None] * E + oe[None, :]
            logit = tl.load(p, mask=m, other=0.0, cache_modifier=".cg")
            for c in range(1, tl.num_programs(1)):  # fixed order over the D chunks, as _router_topk_kernel
                logit += tl.load(p + c * B * E, mask=m, other=0.0, cache_modifier=".cg")
            if STORE_LOGITS:
                tl.store(logits_ptr + rows[:, None] * E + oe[None, :], logit, mask=m)
            _topk_rows(logit, bias_ptr, ids_ptr, tw_ptr, rows, r_ok, E, scaling, TOP_K, K_PAD, E_PAD, RENORM,
                       HAS_BIAS, SHARED)
            tl.atomic_xchg(count_ptr, 0)  # ready for the next launch (graph replays included)


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, ids_ptr, w_ptr, logits_ptr, B, E, E_SLAB, scaling,
                        SPLIT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_LOGITS: tl.constexpr,
                        SHARED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # the partial logits come from the previous kernel
    b = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    ok = offs < E
    # partials [E / E_SLAB slabs, SPLIT, B, E_SLAB]: one slab per rank under TP slicing (one slab: [SPLIT, B, E])
    col = (offs // E_SLAB) * (SPLIT * B * E_SLAB) + offs % E_SLAB
    logit = tl.load(part_ptr + b * E_SLAB + col, mask=ok, other=0.0)
    for c in tl.static_range(1, SPLIT):  # fixed order over the D chunks
        logit += tl.load(part_ptr + (c * B + b) * E_SLAB + col, mask=ok, other=0.0)
    if STORE_LOGITS:
        tl.store(logits_ptr + b * E + offs, logit, mask=ok)
    row = tl.zeros([1], tl.int32) + b
    _topk_rows(logit[None, :], bias_ptr, ids_ptr, w_ptr, row, row < B, E, scaling, TOP_K, K_PAD, E_PAD, RENORM,
               HAS_BIAS, SHARED)


def fuses_topk(cfg: dict, B: int) -> bool:
    """Whether moe_route does the top-k inside the logits launch. Only for one-warp configs: with more
    warps each of its 3k reductions crosses warps through shared memory, and the tail costs more
    than the launch it saves (H200, 4 warps: +4.4 us a layer)."""
    return B <= B_MAX and cfg["num_warps"] == TOPK_WARPS


def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              renormalize: bool = True, scaling: float = 1.0, *, config: dict | None = None,
              logits_out: torch.Tensor | None = None, shared_slot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, D], gate_w [E, D], bias [E] FP32 or None -> (topk_ids [B, k] int32, topk_w [B, k] FP32).
    config overrides the plan; logits_out (FP32 [B, E]) also receives the router logits; shared_slot:
    see router_topk. One launch (the logits kernel's last program does the top-k) where fuses_topk;
    else router_partials + router_topk, with the same bits."""
    B, E = x.shape[0], gate_w.shape[0]
    cfg = config or router_config(E, x.shape[1], gate_w.dtype, B)
    if not fuses_topk(cfg, B):
        part = router_partials(x, gate_w, config=cfg)
        return router_topk(part.unsqueeze(0), bias, top_k, renormalize, scaling, logits_out=logits_out,
                           shared_slot=shared_slot)
    ids, w = _route_outputs(B, E, top_k, logits_out, shared_slot, x.device)
    b = bias.float().contiguous() if bias is not None else w  # dummy pointer when absent
    router_partials(x, gate_w, config=cfg, topk=dict(
        bias_ptr=b, ids_ptr=ids, tw_ptr=w, logits_ptr=logits_out if logits_out is not None else w,
        count_ptr=arrival_counters(x.device, 1), scaling=float(scaling), TOPK=True, TOPK_ROWS=_pow2(B), TOP_K=top_k,
        K_PAD=_pow2(top_k), E_PAD=_pow2(E), RENORM=bool(renormalize), HAS_BIAS=bias is not None,
        STORE_LOGITS=logits_out is not None, SHARED=bool(shared_slot)))
    return ids, w


def _route_outputs(B, E, top_k, logits_out, shared_slot, device):
    assert 0 < top_k <= E
    if logits_out is not None:
        assert logits_out.shape == (B, E) and logits_out.dtype == torch.float32 and logits_out.is_contiguous()
    k_out = top_k + bool(shared_slot)
    return (torch.empty(B, k_out, dtype=torch.int32, device=device),
            torch.empty(B, k_out, dtype=torch.float32, device=device))


def router_partials(x: torch.Tensor, gate_w: torch.Tensor, *, config: dict | None = None,
                    num_experts: int | None = None, topk: dict | None = None) -> torch.Tensor:
    """Split-D partial logits of gate_w's experts: FP32 [D chunks, B, gate_w rows].

    Under TP slicing gate_w is a rank's slice of the num_experts rows: the plan entry (chunks,
    tiles) of the whole router is used, so every expert's partials are the bits the whole-router
    launch computes, and the gathered partials give router_topk the replicated path's exact logits.
    topk: moe_route's fused top-k arguments (outputs, counter, flags)."""
    B, D = x.shape
    E = gate_w.shape[0]
    assert gate_w.shape[1] == D and x.stride(1) == 1 and gate_w.is_contiguous()
    cfg = config or router_config(num_experts or E, D, gate_w.dtype, B)
    assert valid_router(cfg), f"bad router config {cfg}"
    split = triton.cdiv(D, cfg["CHUNK"])
    part = torch.empty(split, B, E, dtype=torch.float32, device=x.device)
    fused = topk or dict(bias_ptr=part, ids_ptr=part, tw_ptr=part, logits_ptr=part, count_ptr=part, scaling=1.0)
    _router_logits_kernel[(triton.cdiv(E, cfg["BLOCK_E"]), split)](
        x, gate_w, part, B, E, D, x.stride(0), cfg["CHUNK"], B_PAD=_token_pad(B), BLOCK_E=cfg["BLOCK_E"],
        BLOCK_K=cfg["BLOCK_K"], DOT=cfg["variant"] == "dot", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **fused, **launch_kwargs(x.device))
    return part


def router_topk(parts: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool = True,
                scaling: float = 1.0, *, logits_out: torch.Tensor | None = None,
                shared_slot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the partials of R slabs of experts, [R, D chunks, B, E/R] (R ranks' router_partials
    stacked in rank order; R = 1 for the whole router): chunks summed in a fixed order, then as moe_route.
    shared_slot: [B, k + 1] results, slot k holding id E and weight 1 (the shared expert, for
    moe_expert_partials' `shared`)."""
    R, split, B, E_slab = parts.shape
    E = R * E_slab
    assert parts.dtype == torch.float32 and parts.is_contiguous()
    ids, w = _route_outputs(B, E, top_k, logits_out, shared_slot, parts.device)
    b = bias.float().contiguous() if bias is not None else parts  # dummy pointer when absent
    _router_topk_kernel[(B,)](parts, b, ids, w, logits_out if logits_out is not None else parts, B, E, E_slab,
                              float(scaling), SPLIT=split, TOP_K=top_k, K_PAD=_pow2(top_k), E_PAD=_pow2(E),
                              RENORM=bool(renormalize), HAS_BIAS=bias is not None, STORE_LOGITS=logits_out is not None,
                              SHARED=bool(shared_slot), num_warps=TOPK_WARPS,
                              **launch_kwargs(parts.device))
    return ids, w


# ----------------------------------------------------------------------------- experts
@triton.jit
def _first_use(ids_ptr, n, e, NK, N_PAD: tl.constexpr):
    """True when no earlier assignment m < n chose expert e."""
    offs_n = tl.arange(0, N_PAD)
    all_ids = tl.load(ids_ptr + offs_n, mask=offs_n < NK, other=-1)
    return tl.sum(((all_ids == e) & (offs_n < n)).to(tl.int32), axis=0) == 0


@triton.jit
def _token_slots(ids_ptr, e, B, TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """Per padded token: did it choose e, and in which slot."""
    offs_b = tl.arange(0, B_PAD)
    offs_s = tl.arange(0, K_PAD)
    match = tl.load(ids_ptr + offs_b[:, None] * TOP_K + offs_s[None, :],
                    mask=(offs_b[:, None] < B) & (offs_s[None, :] < TOP_K), other=-1) == e
    return tl.sum(match.to(tl.int32), axis=1) > 0, tl.sum(tl.where(match, offs_s[None, :], 0), axis=1)


@triton.jit
def _expert_base(w_ptr, s_off, e, E, size, ALIGN: tl.constexpr):
    """Expert e's weight block: its slice of the stack, or (e == E) the shared expert's tensor, s_off
    elements from the stack's start. A selected offset, stated a multiple of ALIGN (the host checks):
    without the hint the compiler cannot prove the loads aligned and stops pipelining them (2x slower)."""
    return w_ptr + tl.multiple_of(tl.where(e == E, s_off, e.to(tl.int64) * size), ALIGN)


@triton.jit
def _gate_up(x_ptr, w13_ptr, chose, offs_i, i_ok, D, I, stride_xb,
             B_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, ACT: tl.constexpr,
             DOT_T: tl.constexpr, PREC: tl.constexpr, BETA: tl.constexpr, BETA_L: tl.constexpr):
    """act(W1_e x, W3_e x) for rows offs_i of the expert, all padded tokens: FP32 [B_PAD, BLOCK_I].
    w13_ptr: the expert's own [2I, D] block."""
    offs_b = tl.arange(0, B_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_rows = w13_ptr + offs_i.to(tl.int64)[:, None] * D
    u_rows = g_rows + I * D
    acc_g = tl.zeros([B_PAD, BLOCK_I], tl.float32)
    acc_u = tl.zeros([B_PAD, BLOCK_I], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        d_ok = d < D
        wm = i_ok[:, None] & d_ok[None, :]
        wg = tl.load(g_rows + d[None, :], mask=wm, other=0.0).to(DOT_T)
        wu = tl.load(u_rows + d[None, :], mask=wm, other=0.0).to(DOT_T)
        x = tl.load(x_ptr + offs_b[:, None] * stride_xb + d[None, :], mask=chose[:, None] & d_ok[None, :],
                    other=0.0).to(DOT_T)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PREC)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PREC)
    if ACT == 0:  # SwiGLU
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    else:  # SiTU in FP32; tanh(z) = 1 - 2/(e^{2z}+1) saturates cleanly to ±1 (no tl.tanh in core); the
        # exponent is capped where tanh is already 1.0 in FP32, so e^{2z} never overflows to inf
        tg = 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * acc_g / BETA, TANH_EXP_MAX)) + 1.0)
        tu = 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * acc_u / BETA_L, TANH_EXP_MAX)) + 1.0)
        h = BETA * tg * tl.sigmoid(acc_g) * (BETA_L * tu)
    return h


@triton.jit
def _expert_up_kernel(x_ptr, w13_ptr, s13_off, ids_ptr, h_ptr, B, E, D, I, stride_xb,
                      TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, ACT: tl.constexpr,
                      DOT_T: tl.constexpr, PREC: tl.constexpr, BETA: tl.constexpr, BETA_L: tl.constexpr,
                      ALIGN: tl.constexpr = 1, SHARED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    n = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < I
    offs_b = tl.arange(0, B_PAD)
    if SHARED and n % TOP_K == TOP_K - 1:  # a shared slot (the last of each token's): known without the router
        if n == TOP_K - 1:  # token 0's serves every token
            # x is the router's own input, complete before this launch: the shared expert streams in while
            # the router runs, and only the store (h's memory may be a buffer the router still reads) waits
            h = _gate_up(x_ptr, w13_ptr + tl.multiple_of(s13_off, ALIGN), offs_b < B, offs_i, i_ok, D, I, stride_xb,
                         B_PAD, BLOCK_I, BLOCK_D, ACT, DOT_T, PREC, BETA, BETA_L)
            pdl_wait(USE_PDL)
            tl.store(h_ptr + (offs_b[:, None] * TOP_K + TOP_K - 1) * I + offs_i[None, :],
                     h.to(h_ptr.dtype.element_ty), mask=(offs_b < B)[:, None] & i_ok[None, :])
    else:
        pdl_wait(USE_PDL)  # the expert ids come from the router: no weight address is known before
        e = tl.load(ids_ptr + n)
        if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):
            chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
            h = _gate_up(x_ptr, _expert_base(w13_ptr, s13_off, e, E, 2 * I * D, ALIGN), chose, offs_i, i_ok, D, I,
                         stride_xb, B_PAD, BLOCK_I, BLOCK_D, ACT, DOT_T, PREC, BETA, BETA_L)
            # h is kept in the weight dtype, as the standard path's activations are
            tl.store(h_ptr + (offs_b[:, None] * TOP_K + slot[:, None]) * I + offs_i[None, :],
                     h.to(h_ptr.dtype.element_ty), mask=chose[:, None] & i_ok[None, :])


@triton.jit
def _down_mac(acc, w, h_rows, i, i_ok, chose, SWAP: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    """acc += one [BLOCK_D, BLOCK_I] W2 tile times the tokens' h columns i (FP32, K in order)."""
    h = tl.load(h_rows + i[None, :], mask=chose[:, None] & i_ok[None, :], other=0.0).to(DOT_T)
    if SWAP:
        acc = tl.dot(w, tl.trans(h), acc, input_precision=PREC)
    else:
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def _expert_down_kernel(h_ptr, w2_ptr, s2_off, ids_ptr, part_ptr, B, E, D, I,
                        TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, SWAP: tl.constexpr,
                        DOT_T: tl.constexpr, PREC: tl.constexpr,
                        ALIGN: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    # The expert ids are two launches back (the router's top-k, then the up kernel): complete when this
    # kernel starts (pdl.py), so the first W2 tile streams in before the wait, while the up kernel ends.
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    first = _first_use(ids_ptr, n, e, B * TOP_K, N_PAD)
    offs_i = tl.arange(0, BLOCK_I)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    w_rows = _expert_base(w2_ptr, s2_off, e, E, D * I, ALIGN) + offs_d.to(tl.int64)[:, None] * I
    i_ok = offs_i < I
    w = tl.load(w_rows + offs_i[None, :], mask=first & d_ok[:, None] & i_ok[None, :], other=0.0).to(DOT_T)
    pdl_wait(USE_PDL)  # h comes from the up kernel just before
    if first:
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        row = tl.arange(0, B_PAD) * TOP_K + slot
        h_rows = h_ptr + row[:, None] * I
        if SWAP:  # weight rows as the M side: [BLOCK_D, tokens] (wgmma-eligible at BLOCK_D >= 64)
            acc = tl.zeros([BLOCK_D, B_PAD], tl.float32)
        else:
            acc = tl.zeros([B_PAD, BLOCK_D], tl.float32)
        acc = _down_mac(acc, w, h_rows, offs_i, i_ok, chose, SWAP, DOT_T, PREC)  # the tile loaded before the wait
        for i0 in range(BLOCK_I, I, BLOCK_I):  # the rest, software-pipelined
            i = i0 + offs_i
            i_ok = i < I
            w = tl.load(w_rows + i[None, :], mask=d_ok[:, None] & i_ok[None, :], other=0.0).to(DOT_T)
            acc = _down_mac(acc, w, h_rows, i, i_ok, chose, SWAP, DOT_T, PREC)
        if SWAP:
            tl.store(part_ptr + row[None, :] * D + offs_d[:, None], acc, mask=chose[None, :] & d_ok[:, None])
        else:
            tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=chose[:, None] & d_ok[None, :])


@triton.jit
def _expert_fused_kernel(x_ptr, w13_ptr, w2_ptr, s13_off, s2_off, ids_ptr, part_ptr, B, E, D, I, stride_xb,
                         TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                         BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr, ACT: tl.constexpr,
                         DOT_T: tl.constexpr, PREC: tl.constexpr, BETA: tl.constexpr, BETA_L: tl.constexpr,
                         ALIGN: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    """Up and down for one I tile: its h never leaves registers; writes part[I tile, b, slot, :]."""
    pdl_wait(USE_PDL)  # the expert ids come from the router: no weight address is known before
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        j = tl.program_id(1)
        offs_i = j * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        h = _gate_up(x_ptr, _expert_base(w13_ptr, s13_off, e, E, 2 * I * D, ALIGN), chose, offs_i, i_ok, D, I, stride_xb,
                     B_PAD, BLOCK_I, BLOCK_D, ACT, DOT_T, PREC, BETA, BETA_L)
        h = h.to(w2_ptr.dtype.element_ty).to(DOT_T)  # rounded like the split path's workspace
        offs_b = tl.arange(0, B_PAD)
        offs_do = tl.arange(0, BLOCK_DO)
        w_cols = _expert_base(w2_ptr, s2_off, e, E, D * I, ALIGN) + offs_i[None, :]
        out_rows = part_ptr + (j * B * TOP_K + offs_b * TOP_K + slot).to(tl.int64)[:, None] * D
        for d0 in range(0, D, BLOCK_DO):
            d = d0 + offs_do
            d_ok = d < D
            w = tl.load(w_cols + d.to(tl.int64)[:, None] * I, mask=d_ok[:, None] & i_ok[None, :], other=0.0)
            y = tl.dot(h, tl.trans(w.to(DOT_T)), input_precision=PREC)
            tl.store(out_rows + d[None, :], y, mask=chose[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(part_ptr, tw_ptr, add_ptr, out_ptr, B, D, NJ, stride_ob, stride_ab,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    """out[b] = Σ_slot tw[b, slot] · Σ_j part[j, b, slot] (+ add[b]): one fixed order for every B."""
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    offs_s = tl.arange(0, K_PAD)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = (offs_s[:, None] < TOP_K) & d_ok[None, :]
    ptrs = part_ptr + (b * TOP_K + offs_s[:, None]).to(tl.int64) * D + offs_d[None, :]
    tot = tl.load(ptrs, mask=m, other=0.0)
    for j in range(1, NJ):
        tot += tl.load(ptrs + j * B * TOP_K * D, mask=m, other=0.0)
    tw = tl.load(tw_ptr + b * TOP_K + offs_s, mask=offs_s < TOP_K, other=0.0)
    acc = tl.sum(tot * tw[:, None], axis=0)
    if HAS_ADD:
        acc += tl.load(add_ptr + b * stride_ab + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def _dot_meta(wdtype: torch.dtype) -> dict:
    # FP32 weights: exact FP32 products (no TF32). The interpreter's tl.dot mis-reads
    # BF16 operands, so it gets FP32 too (BF16 products are exact in FP32 anyway).
    if wdtype == torch.float32 or interpreting():
        return dict(DOT_T=tl.float32, PREC="ieee")
    return dict(DOT_T=tl.bfloat16 if wdtype == torch.bfloat16 else tl.float16, PREC="tf32")  # PREC unused for 16-bit


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_w: torch.Tensor, *, activation: str = "swiglu", out: torch.Tensor | None = None,
                workspace: torch.Tensor | None = None, add: torch.Tensor | None = None,
                config: dict | None = None, partials: torch.Tensor | None = None) -> torch.Tensor:
    """out[b] = Σ_k topk_w[b,k] · W2_e act(W1_e x_b, W3_e x_b) (+ add[b]), e = topk_ids[b,k]; out in x.dtype.

    w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I], topk_ids [B, k] int32 (distinct per token),
    topk_w [B, k] FP32. add: optional [B, D] (the shared expert) summed in FP32 before the one rounding.
    config overrides the plan; workspace / partials: see moe_expert_partials.
    """
    part = moe_expert_partials(x, w13, w2, topk_ids, activation=activation, workspace=workspace, config=config,
                               partials=partials)
    return moe_combine(part, topk_w, out=out, add=add, dtype=x.dtype)


def _elements_between(base: torch.Tensor, t: torch.Tensor) -> int:
    """t's start as an element offset from base's (one flat device address space; may be negative)."""
    d = t.data_ptr() - base.data_ptr()
    assert d % base.element_size() == 0
    return d // base.element_size()


def moe_expert_partials(x, w13, w2, topk_ids, *, activation: str = "swiglu", workspace=None, config=None,
                        partials=None, shared=None) -> torch.Tensor:
    """The expert launches without the combine: FP32 partials [I tiles, B·k, D] (unweighted), row
    b·k + slot holding token b's slot-th expert output (over one I tile for the fused variant).
    workspace: optional [B, k, I] in the weight dtype for h (split variant); partials: optional output.
    shared: (gate_up [2I, D], down [D, I]) of a shared expert of the routed experts' shape, served
    wherever topk_ids holds E (router_topk's shared_slot): one more expert in the same launches."""
    B, D = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    assert w13.shape == (E, 2 * I, D) and w2.shape == (E, D, I) and w13.dtype == w2.dtype
    assert w13.is_contiguous() and w2.is_contiguous() and x.stride(1) == 1
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() and topk_ids.shape[0] == B
    s13_off = s2_off = 0  # never used without a shared slot (no id is E)
    if shared is not None:
        s13, s2 = shared
        assert s13.shape == (2 * I, D) and s2.shape == (D, I), "the shared expert must have the routed experts' shape"
        assert s13.dtype == s2.dtype == w13.dtype and s13.is_contiguous() and s2.is_contiguous()
        assert s13.device == w13.device and s2.device == w2.device
        s13_off, s2_off = _elements_between(w13, s13), _elements_between(w2, s2)
    align = math.gcd(MAX_ALIGN, 2 * I * D, D * I, s13_off, s2_off)  # gcd(16, ...): a power of two
    cfg = config or experts_config(E, D, I, k - (shared is not None), w13.dtype, B, shared=shared is not None)
    assert valid_experts(cfg), f"bad experts config {cfg}"
    pshape = partials_shape(cfg, B, D, I, k)
    part = partials if partials is not None else torch.empty(pshape, dtype=torch.float32, device=x.device)
    assert part.shape == pshape and part.dtype == torch.float32 and part.is_contiguous()
    B_PAD = _token_pad(B)
    meta = dict(TOP_K=k, B_PAD=B_PAD, K_PAD=_pow2(k), N_PAD=_pow2(B_PAD * k), **_dot_meta(w13.dtype),
                ALIGN=align, **launch_kwargs(x.device))
    act = dict(ACT=ACTIVATIONS[activation], BETA=SITU_BETA, BETA_L=SITU_LINEAR_BETA)
    if cfg["variant"] == "split":
        h = workspace if workspace is not None else torch.empty(B, k, I, dtype=w13.dtype, device=x.device)
        assert h.shape == (B, k, I) and h.dtype == w13.dtype and h.is_contiguous()
        _expert_up_kernel[(B * k, triton.cdiv(I, cfg["UP_BLOCK_I"]))](
            x, w13, s13_off, topk_ids, h, B, E, D, I, x.stride(0), BLOCK_I=cfg["UP_BLOCK_I"], BLOCK_D=cfg["UP_BLOCK_D"],
            SHARED=shared is not None,
            num_warps=cfg["up_warps"], num_stages=cfg["up_stages"], **act, **meta)
        _expert_down_kernel[(B * k, triton.cdiv(D, cfg["DOWN_BLOCK_D"]))](
            h, w2, s2_off, topk_ids, part, B, E, D, I, BLOCK_D=cfg["DOWN_BLOCK_D"], BLOCK_I=cfg["DOWN_BLOCK_I"],
            SWAP=bool(cfg.get("SWAP", False)),
            num_warps=cfg["down_warps"], num_stages=cfg["down_stages"], **meta)
    else:
        _expert_fused_kernel[(B * k, pshape[0])](
            x, w13, w2, s13_off, s2_off, topk_ids, part, B, E, D, I, x.stride(0), BLOCK_I=cfg["BLOCK_I"], BLOCK_D=cfg["BLOCK_D"],
            BLOCK_DO=cfg["BLOCK_DO"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **act, **meta)
    return part


def moe_combine(part: torch.Tensor, topk_w: torch.Tensor, *, out: torch.Tensor | None = None,
                add: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[b] = Σ_slot topk_w[b, slot] · Σ_tile part[tile, b·k + slot] (+ add[b]), one fixed order."""
    nj, bk, D = part.shape
    B, k = topk_w.shape
    assert bk == B * k and part.dtype == torch.float32 and part.is_contiguous()
    topk_w = topk_w.float().contiguous()
    if out is None:
        out = torch.empty(B, D, dtype=dtype or (add.dtype if add is not None else torch.float32), device=part.device)
    assert out.shape == (B, D) and out.stride(1) == 1
    if add is not None:
        assert add.shape == (B, D) and add.stride(1) == 1
    _combine_kernel[(B, triton.cdiv(D, COMBINE_BLOCK_D))](
        part, topk_w, add if add is not None else out, out, B, D, nj, out.stride(0),
        add.stride(0) if add is not None else 0, TOP_K=k, K_PAD=_pow2(k), BLOCK_D=COMBINE_BLOCK_D,
        HAS_ADD=add is not None, **launch_kwargs(part.device))
    return out


def partials_shape(cfg: dict, B: int, D: int, I: int, k: int) -> tuple[int, int, int]:
    """FP32 partial outputs [I tiles, B·k, D]: one I tile for split, I/BLOCK_I for fused."""
    return (1 if cfg["variant"] == "split" else triton.cdiv(I, cfg["BLOCK_I"]), B * k, D)


def order_class(cfg: dict) -> str:
    """Configs of one class give a token the same bits (only these choices change the sum order)."""
    if cfg["variant"] == "split":
        return f"split,swap={bool(cfg.get('SWAP', False))}"
    if cfg["variant"] == "fused":
        return f"fused,BLOCK_I={cfg['BLOCK_I']}"
    if cfg["variant"] == "dot":  # router: IEEE dot chains over K in order; chunks summed in order
        return f"dot,CHUNK={cfg['CHUNK']}"
    return "fma," + ",".join(f"{f}={cfg[f]}" for f in ROUTER_INTS)  # tree sums depend on the whole layout


def moe_forward(x, gate_w, bias, w13, w2, top_k: int, renormalize: bool = True, scaling: float = 1.0,
                activation: str = "swiglu", out=None, add=None) -> torch.Tensor:
    """Routed part of the MoE layer (+ optional add, e.g. the shared expert): route then experts."""
    ids, w = moe_route(x, gate_w, bias, top_k, renormalize, scaling)
    return moe_experts(x, w13, w2, ids, w, activation=activation, out=out, add=add)


# ----------------------------------------------------------------------------- references (FP32)
def moe_route_ref(x, gate_w, bias, top_k: int, renormalize: bool = True, scaling: float = 1.0):
    """docs/models.md router in FP32; ties broken toward the lowest expert index (stable sort)."""
    return moe_select_ref(x.float() @ gate_w.float().t(), bias, top_k, renormalize, scaling)


def moe_select_ref(logits, bias, top_k: int, renormalize: bool = True, scaling: float = 1.0):
    """moe_route_ref from the router's logits [N, E] (FP32)."""
    s = torch.sigmoid(logits.float())
    choice = s + (bias.float() if bias is not None else 0.0)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32), w * scaling


def moe_experts_ref(x, w13, w2, topk_ids, topk_w, activation: str = "swiglu") -> torch.Tensor:
    """Loop over tokens and their chosen experts, all in FP32. Returns FP32 [B, D]."""
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for b in range(x.shape[0]):
        xb = x[b].float()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[b, j])
            h = act_ref(w13[e, :I].float() @ xb, w13[e, I:].float() @ xb, activation)
            out[b] += float(topk_w[b, j]) * (w2[e].float() @ h)
    return out


def act_ref(g: torch.Tensor, u: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """act(gate, up) in FP32: SwiGLU or SiTU (docs/models.md)."""
    if activation == "swiglu":
        return torch.nn.functional.silu(g) * u
    return SITU_BETA * torch.tanh(g / SITU_BETA) * torch.sigmoid(g) * SITU_LINEAR_BETA * torch.tanh(u / SITU_LINEAR_BETA)
