"""Fused MoE decode kernels vs independent FP32 references (docs/correctness.md §1).

CPU (interpreter): tiny and odd shapes, every variant. GPU pass: also the real
Kimi-Linear shapes. The "each expert read once" design is proven indirectly:
duplicate-heavy routings (all tokens on the same experts) must give the same
answer as the per-token loop, which they only can if the one working program
serves every token that chose e.
"""
import functools
import json

import pytest
import torch

from peregrine.kernels import available, moe
from peregrine.kernels.moe import (moe_combine, moe_expert_partials, moe_experts, moe_forward, moe_route, router_partials,
                                  router_topk)
from peregrine.testing import SENTINEL, assert_close, poisoned
from conftest import DEVICE, FULL_SHAPES, run_aot

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LOGIT_TOL = 1e-6  # router logits: FP32 products and sums vs FP64
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # docs/models.md, restated here so the reference is independent
REAL = dict(D=2304, I=1024, E=256, k=8)  # kimi-linear-48b-a3b
TINY = dict(D=256, I=128, E=16, k=4)     # tiny-kimi-linear
ODD = dict(D=100, I=48, E=5, k=2)        # nothing a multiple of a tile
F32, BF16 = torch.float32, torch.bfloat16

# Every code path, with tiles small enough that the CPU shapes span several of them.
ROUTER_VARIANTS = {
    "default": moe.DEFAULT_ROUTER,
    "dot_chunk32": dict(variant="dot", BLOCK_E=16, BLOCK_K=16, CHUNK=32, num_warps=4, num_stages=2),
    "fma": dict(variant="fma", BLOCK_E=4, BLOCK_K=32, CHUNK=64, num_warps=4, num_stages=2),
    "fma_one_chunk": dict(variant="fma", BLOCK_E=2, BLOCK_K=64, CHUNK=4096, num_warps=2, num_stages=2),
}
EXPERT_VARIANTS = {
    "default": moe.DEFAULT_EXPERTS,
    "split_small": moe.DEFAULT_EXPERTS | dict(UP_BLOCK_I=16, UP_BLOCK_D=32, DOWN_BLOCK_D=16, DOWN_BLOCK_I=32),
    "split_swap": moe.DEFAULT_EXPERTS | dict(UP_BLOCK_I=16, UP_BLOCK_D=64, DOWN_BLOCK_D=32, DOWN_BLOCK_I=16,
                                             SWAP=True),
    "fused": dict(variant="fused", BLOCK_I=16, BLOCK_D=32, BLOCK_DO=32, num_warps=4, num_stages=2),
    "fused_wide": dict(variant="fused", BLOCK_I=32, BLOCK_D=64, BLOCK_DO=64, num_warps=4, num_stages=3),
}


# --------------------------------------------------------------------------- references (FP32/FP64, docs/models.md)
def route_ref(x, gate_w, bias, k, renormalize, scaling):
    logits = x.double() @ gate_w.double().t()
    s = torch.sigmoid(logits).float()
    order = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices  # ties: lowest index
    ids = order[:, :k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling, logits


def experts_ref(x, w13, w2, ids, w, activation):
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for b in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[b, j])
            g = w13[e, :I].float() @ x[b].float()
            u = w13[e, I:].float() @ x[b].float()
            if activation == "swiglu":
                h = g * torch.sigmoid(g) * u
            else:
                h = SITU_BETA * torch.tanh(g / SITU_BETA) * torch.sigmoid(g) * SITU_LINEAR_BETA * torch.tanh(u / SITU_LINEAR_BETA)
            out[b] += w[b, j].float() * (w2[e].float() @ h)
    return out


# --------------------------------------------------------------------------- inputs
@functools.lru_cache(maxsize=2)  # real shapes are 3.6 GB: drawn on the device, once per (shape, dtype, seed)
def make_weights(D, I, E, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, D, generator=g, device=DEVICE) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, generator=g, device=DEVICE) / I**0.5).to(dtype)
    return w13, w2


def make_routing(B, E, k, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)])
    elif kind == "same":  # every token picks the same set (in a token-dependent order)
        base = torch.randperm(E, generator=g)[:k]
        ids = torch.stack([base.roll(b) for b in range(B)])
    elif kind == "distinct":  # no expert shared between tokens
        ids = torch.randperm(E, generator=g)[: B * k].view(B, k)
    w = torch.rand(B, k, generator=g) + 0.1
    return ids.to(torch.int32).to(DEVICE), w.to(DEVICE)


def make_x(B, D, dtype, seed=1, strided=False):
    x = torch.randn(B, D + 8 if strided else D, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    return x[:, 3:3 + D] if strided else x  # strided: row stride D+8, offset start


# --------------------------------------------------------------------------- router
ROUTER_CASES = [(1, TINY, 1, F32, "default"), (3, ODD, 2, BF16, "default"), (16, TINY, 3, BF16, "dot_chunk32"),
                (16, TINY, 3, F32, "fma"), (5, ODD, 4, F32, "fma_one_chunk"), (2, ODD, 4, BF16, "dot_chunk32"),
                (7, REAL, 4, BF16, "default")]
if FULL_SHAPES:
    ROUTER_CASES += [(B, REAL, 10 + B, dt, v) for B in (1, 2, 4, 8, 16) for dt in (F32, BF16) for v in ROUTER_VARIANTS]


@pytest.mark.parametrize("B,shape,seed,dtype,variant", ROUTER_CASES)
def test_route_matches_reference(B, shape, seed, dtype, variant):
    D, E, k = shape["D"], shape["E"], shape["k"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g).to(dtype).to(DEVICE)
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).to(dtype).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.05).to(DEVICE)
    logits = poisoned((B, E), F32, DEVICE)
    ids, w = moe_route(x, gate_w, bias, k, renormalize=True, scaling=2.446, config=ROUTER_VARIANTS[variant],
                       logits_out=logits)
    rid, rw, rlogits = route_ref(x, gate_w, bias, k, True, 2.446)
    assert (logits.double() - rlogits).abs().max().item() <= LOGIT_TOL * (1 + rlogits.abs().max().item())
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long().sort(-1).values, rid.sort(-1).values), "chosen expert sets differ"
    got = w.gather(1, ids.long().argsort(-1))  # compare weights expert by expert
    want = rw.gather(1, rid.argsort(-1))
    assert (got - want).abs().max().item() <= 1e-6 * 2.446


def test_route_ties_pick_lowest_index_and_no_renorm():
    D, E, k = 64, 7, 3
    g = torch.Generator().manual_seed(5)
    row = torch.randn(D, generator=g)
    gate_w = torch.stack([row] * E).to(DEVICE)  # every expert scores the same
    x = torch.randn(2, D, generator=g).to(DEVICE)
    bias = torch.zeros(E, device=DEVICE)
    ids, w = moe_route(x, gate_w, bias, k, renormalize=False, scaling=1.5)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    s = torch.sigmoid(x.double() @ row.double().to(DEVICE)).float()
    assert torch.allclose(w, (s * 1.5)[:, None].expand(2, k), atol=1e-6, rtol=0)
    bias[4] = 1.0  # a bias moves expert 4 to the front, but its weight stays σ(logit) (not s + bias)
    ids, w = moe_route(x, gate_w, bias, k, renormalize=False, scaling=1.0)
    assert ids.tolist() == [[4, 0, 1], [4, 0, 1]]
    assert torch.allclose(w, s[:, None].expand(2, k), atol=1e-6, rtol=0)
    ids, _ = moe_route(x, gate_w, None, k, renormalize=False)  # no bias: back to the lowest indices
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("B", [1, 3])
def test_route_orders_negative_and_tied_choices(B):
    """Choices below zero (a negative bias), ties among them and among positive ones, and a column
    padded past E must still come out as a stable descending sort."""
    D, E, k = 16, 40, 7
    g = torch.Generator().manual_seed(21)
    levels = torch.tensor([-3.0, -1.0, 0.0, 0.5, 2.0])
    gate_w = torch.zeros(E, D)
    gate_w[:, 0] = levels[torch.randint(0, len(levels), (E,), generator=g)]  # x = e_0: logit = gate_w[:, 0] exactly
    bias = torch.where(torch.rand(E, generator=g) < 0.5, -1.5, 0.25) * (torch.rand(E, generator=g) < 0.8)
    x = torch.zeros(B, D)
    x[:, 0] = 1.0
    for renorm in (True, False):
        ids, w = moe_route(x.to(DEVICE), gate_w.to(DEVICE), bias.to(DEVICE), k, renormalize=renorm, scaling=2.0)
        rid, rw, _ = route_ref(x, gate_w, bias, k, renorm, 2.0)
        choice = torch.sigmoid(gate_w[:, 0]) + bias
        assert (choice < 0).sum() >= k and (choice > 0).sum() >= k, "the case must mix signs"
        assert ids.cpu().tolist() == rid.tolist(), "slot order differs from a stable descending sort"
        assert torch.allclose(w.cpu(), rw, atol=1e-6, rtol=0)
    neg = bias - 10.0  # every choice negative: the order among negatives decides all k picks
    ids, _ = moe_route(x.to(DEVICE), gate_w.to(DEVICE), neg.to(DEVICE), k, renormalize=False)
    assert ids.cpu().tolist() == route_ref(x, gate_w, neg, k, False, 1.0)[0].tolist()


@pytest.mark.parametrize("variant", ["dot_chunk32", "fma"])
def test_route_logits_batch_invariant(variant):
    D, E = 100, 20
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, D, generator=g).to(DEVICE)
    gate_w = torch.randn(E, D, generator=g).to(DEVICE)
    cfg = ROUTER_VARIANTS[variant]
    full, alone = torch.empty(6, E, device=DEVICE), torch.empty(1, E, device=DEVICE)
    moe_route(x, gate_w, None, 2, config=cfg, logits_out=full)
    moe_route(x[4:5], gate_w, None, 2, config=cfg, logits_out=alone)
    assert torch.equal(alone[0], full[4]), "a token's router logits depend on the rest of its batch"


# (ranks, B, shape, dtype, variant): E = 16 in 2/4/8 slabs, an E/N (10/5) below one BLOCK_E tile
SLICED_ROUTER_CASES = [(2, 3, TINY, F32, "dot_chunk32"), (4, 1, TINY, BF16, "fma"), (8, 5, TINY, F32, "default"),
                       (5, 2, dict(D=100, E=50, k=6), F32, "fma_one_chunk")]


@pytest.mark.parametrize("ranks,B,shape,dtype,variant", SLICED_ROUTER_CASES)
def test_sliced_router_gathered_equals_whole(ranks, B, shape, dtype, variant):
    """TP slicing: each rank's partials on its E/N gate rows, stacked in rank order, give the whole
    router's exact logits, ids and weights (same plan entry: the same chunks and sum order)."""
    D, E, k = shape["D"], shape["E"], shape["k"]
    g = torch.Generator().manual_seed(ranks * 10 + B)
    x = torch.randn(B, D, generator=g).to(dtype).to(DEVICE)
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).to(dtype).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.05).to(DEVICE)
    cfg = ROUTER_VARIANTS[variant]
    whole_logits, logits = poisoned((B, E), F32, DEVICE), poisoned((B, E), F32, DEVICE)
    wid, ww = moe_route(x, gate_w, bias, k, renormalize=True, scaling=2.446, config=cfg, logits_out=whole_logits)
    parts = torch.stack([router_partials(x, s.contiguous(), config=cfg) for s in gate_w.chunk(ranks, 0)])
    ids, w = router_topk(parts, bias, k, renormalize=True, scaling=2.446, logits_out=logits)
    assert torch.equal(logits, whole_logits), "gathered slabs' logits differ from the whole router's"
    assert torch.equal(ids, wid) and torch.equal(w, ww)
    rid, rw, rlogits = route_ref(x, gate_w, bias, k, True, 2.446)  # and both are the router, not just alike
    assert (logits.double() - rlogits).abs().max().item() <= LOGIT_TOL * (1 + rlogits.abs().max().item())
    assert torch.equal(ids.long().sort(-1).values, rid.sort(-1).values)


# (B, shape, dtype, variant, bias, shared slot): one chunk and many, B = 1 and the padded-tile edge
FUSED_ROUTER_CASES = [(1, TINY, F32, "default", True, False), (3, ODD, BF16, "fma", False, True),
                      (16, TINY, F32, "dot_chunk32", True, True), (5, dict(D=100, E=50, k=6), F32, "fma_one_chunk",
                                                                      True, False)]


@pytest.mark.parametrize("B,shape,dtype,variant,with_bias,shared", FUSED_ROUTER_CASES)
def test_fused_router_is_one_launch_with_the_two_launch_bits(monkeypatch, B, shape, dtype, variant, with_bias, shared):
    """The logits kernel's last program does the top-k: no second launch, ids / weights / logits
    bit-identical to router_partials + router_topk, and the arrival counter back at 0 (for replays)."""
    D, E, k = shape["D"], shape["E"], shape["k"]
    g = torch.Generator().manual_seed(B * 7 + E)
    x = torch.randn(B, D, generator=g).to(dtype).to(DEVICE)
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).to(dtype).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.05).to(DEVICE) if with_bias else None
    cfg = ROUTER_VARIANTS[variant] | {"num_warps": moe.TOPK_WARPS}  # the configs that fuse
    assert moe.fuses_topk(cfg, B) and not moe.fuses_topk(cfg | {"num_warps": 4}, B)
    two_logits = poisoned((B, E), F32, DEVICE)  # the two launches moe_route takes for configs that do not fuse
    two = moe.router_topk(moe.router_partials(x, gate_w, config=cfg).unsqueeze(0), bias, k, True, 2.446,
                          logits_out=two_logits, shared_slot=shared)
    taken = []
    monkeypatch.setattr(moe, "arrival_counters", lambda dev, n: taken.append(torch.zeros(n, dtype=torch.int32,
                                                                                         device=dev)) or taken[-1])

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the fused router launched the top-k kernel")
    monkeypatch.setattr(moe, "_router_topk_kernel", NoLaunch())
    logits = poisoned((B, E), F32, DEVICE)
    ids, w = moe_route(x, gate_w, bias, k, True, 2.446, config=cfg, logits_out=logits, shared_slot=shared)
    assert torch.equal(ids, two[0]) and torch.equal(w, two[1]) and torch.equal(logits, two_logits)
    assert len(taken) == 1 and taken[0].tolist() == [0], "the arrival counter was not reset"
    rid, rw, rlogits = route_ref(x, gate_w, bias if with_bias else torch.zeros(E, device=DEVICE), k, True, 2.446)
    assert torch.equal(ids[:, :k].long().sort(-1).values, rid.sort(-1).values)  # and it is the router
    assert (not shared) or (ids[:, k] == E).all() and (w[:, k] == 1).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_fused_router_replays_in_a_cuda_graph():
    """Replays reuse one captured counter: it must be reset by each launch's last program."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2304, generator=g).to(BF16).to(DEVICE)
    gate_w = (torch.randn(256, 2304, generator=g) / 48).to(BF16).to(DEVICE)
    bias = (torch.randn(256, generator=g) * 0.05).to(DEVICE)
    cfg = ROUTER_VARIANTS["fma"] | {"num_warps": moe.TOPK_WARPS}
    route = functools.partial(moe_route, x, gate_w, bias, 8, True, 2.446, config=cfg, shared_slot=True)
    want = route()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        route()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            got = route()
    for _ in range(3):
        got[0].fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_router_partials_use_the_whole_routers_plan(monkeypatch):
    """A rank's slice looks up the plan entry of num_experts, not of its own row count."""
    seen = []
    monkeypatch.setattr(moe, "router_config", lambda E, D, dt, B: seen.append(E) or moe.DEFAULT_ROUTER)
    x = torch.randn(2, 64, device=DEVICE)
    router_partials(x, torch.randn(4, 64, device=DEVICE), num_experts=16)
    router_partials(x, torch.randn(4, 64, device=DEVICE))
    assert seen == [16, 4]


# --------------------------------------------------------------------------- experts
# (B, shape, dtype, activation, routing kind, variant)
EXPERT_CASES = [
    (1, TINY, BF16, "swiglu", "random", "default"),
    (3, ODD, F32, "situ", "random", "split_small"),
    (7, ODD, BF16, "swiglu", "same", "split_swap"),
    (16, TINY, F32, "swiglu", "same", "default"),
    (2, ODD, F32, "situ", "distinct", "split_swap"),
    (2, ODD, BF16, "situ", "distinct", "fused"),
    (16, TINY, BF16, "swiglu", "random", "fused_wide"),
    (5, ODD, F32, "swiglu", "same", "fused_wide"),
    (1, TINY, F32, "situ", "random", "fused_wide"),
]
if FULL_SHAPES:
    EXPERT_CASES += [(B, REAL, BF16, "swiglu", kind, v) for B in (1, 2, 4, 8, 16) for kind in ("random", "same")
                     for v in ("default", "split_swap", "fused_wide")]
    EXPERT_CASES += [(B, REAL, BF16, "situ", "random", v) for B in (1, 8) for v in ("default", "fused")]


def _case_id(c):
    B, shape, dtype, act, kind, variant = c
    return f"B{B}-D{shape['D']}-I{shape['I']}-E{shape['E']}-k{shape['k']}-{str(dtype)[6:]}-{act}-{kind}-{variant}"


@pytest.mark.parametrize("case", EXPERT_CASES, ids=_case_id)
def test_experts_match_reference(case):
    B, shape, dtype, act, kind, variant = case
    D, I, E, k = shape["D"], shape["I"], shape["E"], shape["k"]
    cfg = EXPERT_VARIANTS[variant]
    w13, w2 = make_weights(D, I, E, dtype, seed=0 if shape is REAL else B)  # one real-shape draw for all cases
    ids, w = make_routing(B, E, k, kind, seed=B)
    x = make_x(B, D, dtype, seed=B, strided=B % 2 == 1)
    out = poisoned((B, D), dtype, DEVICE)
    part = poisoned(moe.partials_shape(cfg, B, D, I, k), F32, DEVICE)  # every (tile, token, slot) row written
    ws = poisoned((B, k, I), dtype, DEVICE) if cfg["variant"] == "split" else None
    res = moe_experts(x, w13, w2, ids, w, activation=act, out=out, workspace=ws, config=cfg, partials=part)
    assert res is out and res.dtype == dtype
    assert torch.isfinite(part).all(), "a (tile, token, slot) partial row was never written"
    if ws is not None:
        assert torch.isfinite(ws).all(), "a (token, slot) activation row was never written"
    assert_close(out, experts_ref(x, w13, w2, ids, w, act), TOL[dtype], f"moe_experts {_case_id(case)}")


@pytest.mark.parametrize("variant", ["default", "split_swap", "fused"])
def test_experts_bitwise_reproducible_and_batch_invariant(variant):
    B, D, I, E, k = 5, 64, 32, 12, 2  # small: four calls under the interpreter
    cfg = EXPERT_VARIANTS[variant]
    w13, w2 = make_weights(D, I, E, BF16, seed=7)
    ids, w = make_routing(B, E, k, "random", seed=7)
    ids[1] = ids[0]  # a shared expert set, so the batch changes who does the work
    x = make_x(B, D, BF16, seed=7)
    a = moe_experts(x, w13, w2, ids, w, config=cfg)
    b = moe_experts(x, w13, w2, ids, w, config=cfg, out=poisoned((B, D), BF16, DEVICE))
    assert torch.equal(a, b), "two runs on the same inputs differ: a race or an order-dependent combine"
    alone = moe_experts(x[1:2], w13, w2, ids[1:2].contiguous(), w[1:2], config=cfg)
    assert torch.equal(alone[0], a[1]), "a token's output depends on the rest of its batch"
    perm = torch.tensor([3, 1, 4, 0, 2], device=DEVICE)  # same tokens, other order: same rows
    shuf = moe_experts(x[perm].contiguous(), w13, w2, ids[perm].contiguous(), w[perm], config=cfg)
    assert torch.equal(shuf, a[perm]), "a token's output depends on its position in the batch"


SHARED_CASES = [(1, TINY, BF16, "default"), (3, ODD, F32, "split_swap"), (16, TINY, BF16, "fused_wide"),
                (5, ODD, BF16, "fused")]
if FULL_SHAPES:
    SHARED_CASES += [(B, REAL, BF16, v) for B in (1, 2, 4, 8) for v in ("default", "split_swap")]


@pytest.mark.parametrize("B,shape,dtype,variant", SHARED_CASES)
def test_shared_slot_serves_the_shared_expert_as_one_more_expert(B, shape, dtype, variant):
    """router_topk's shared slot (id E, weight 1) and the expert launches' shared weights give the
    reference's routed experts plus the shared expert, the latter taken as expert E of a stack that
    holds it after the routed ones; the k routed slots are the plain top-k's ids and weights."""
    D, I, E, k = shape["D"], shape["I"], shape["E"], shape["k"]
    cfg = EXPERT_VARIANTS[variant]
    w13, w2 = make_weights(D, I, E, dtype, seed=0 if shape is REAL else B)
    g = torch.Generator(device=DEVICE).manual_seed(99)
    s13 = (torch.randn(2 * I, D, generator=g, device=DEVICE) / D**0.5).to(dtype)
    s2 = (torch.randn(D, I, generator=g, device=DEVICE) / I**0.5).to(dtype)
    x = make_x(B, D, dtype, seed=B, strided=B % 2 == 1)
    gate_w = (torch.randn(E, D, generator=g, device=DEVICE) / D**0.5).to(dtype)
    bias = torch.randn(E, generator=g, device=DEVICE) * 0.1
    ids, w = moe_route(x, gate_w, bias, k, True, 2.5)
    ids_s, w_s = moe_route(x, gate_w, bias, k, True, 2.5, shared_slot=True)
    assert ids_s.shape == (B, k + 1) and torch.equal(ids_s[:, :k], ids) and torch.equal(w_s[:, :k], w)
    assert (ids_s[:, k] == E).all() and (w_s[:, k] == 1).all()
    part = poisoned(moe.partials_shape(cfg, B, D, I, k + 1), F32, DEVICE)
    moe_expert_partials(x, w13, w2, ids_s, config=cfg, partials=part, shared=(s13, s2))
    assert torch.isfinite(part).all(), "a (tile, token, slot) partial row was never written"
    out = moe_combine(part, w_s, dtype=dtype, out=poisoned((B, D), dtype, DEVICE))
    want = experts_ref(x, torch.cat([w13, s13[None]]), torch.cat([w2, s2[None]]), ids_s, w_s, "swiglu")
    assert_close(out, want, TOL[dtype], f"shared slot B={B} {variant}")


def test_combine_adds_in_fp32_and_leaves_neighbours():
    """The shared expert rides along in the combine; a strided out slice keeps its neighbours."""
    B, D, I, E, k = 3, 100, 48, 5, 2
    w13, w2 = make_weights(D, I, E, BF16, seed=3)
    ids, w = make_routing(B, E, k, "random", seed=3)
    x = make_x(B, D, BF16, seed=3)
    add = make_x(B, D, BF16, seed=4, strided=True)
    buf = torch.full((B + 2, D + 20), SENTINEL, dtype=BF16, device=DEVICE)
    before = buf.clone()
    out = buf[1:B + 1, 10:10 + D]
    out.fill_(float("nan"))
    part = moe_expert_partials(x, w13, w2, ids, config=EXPERT_VARIANTS["split_small"])
    moe_combine(part, w, out=out, add=add)
    want = experts_ref(x, w13, w2, ids, w, "swiglu") + add.float()
    assert_close(out, want, TOL[BF16], "combine + add")
    keep = torch.ones_like(buf, dtype=torch.bool)
    keep[1:B + 1, 10:10 + D] = False
    assert torch.equal(buf[keep], before[keep]), "neighbours of the out slice were touched"
    fresh = moe_combine(part, w, add=add)  # no out: allocated in the add's dtype
    assert fresh.dtype == BF16 and torch.equal(fresh, out)


def test_forward_end_to_end():
    B, D, I, E, k = 3, TINY["D"], TINY["I"], TINY["E"], TINY["k"]
    w13, w2 = make_weights(D, I, E, F32, seed=11)
    g = torch.Generator().manual_seed(11)
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.05).to(DEVICE)
    x = make_x(B, D, F32, seed=11)
    out = moe_forward(x, gate_w, bias, w13, w2, k, True, 2.446)
    rid, rw, _ = route_ref(x, gate_w, bias, k, True, 2.446)
    assert_close(out, experts_ref(x, w13, w2, rid, rw, "swiglu"), TOL[F32], "moe_forward")


@pytest.mark.skipif(DEVICE != "cuda", reason="tensor-core bits: the interpreter's numpy dot sums in its own order")
def test_one_order_class_gives_identical_bits():
    """The plan may pick other tiles per B only because tiles do not move a token's bits within a class."""
    D, I, E, k, B = REAL["D"], REAL["I"], 32, REAL["k"], 4
    w13, w2 = make_weights(D, I, E, BF16, seed=5)
    ids, w = make_routing(B, E, k, "random", seed=5)
    x = make_x(B, D, BF16, seed=5)
    outs = [moe_experts(x, w13, w2, ids, w, config=moe.DEFAULT_EXPERTS | t) for t in (
        {}, dict(UP_BLOCK_I=64, UP_BLOCK_D=128, DOWN_BLOCK_D=32, DOWN_BLOCK_I=256, down_stages=4),
        dict(UP_BLOCK_I=16, UP_BLOCK_D=512, DOWN_BLOCK_D=128, DOWN_BLOCK_I=64, down_warps=8))]
    assert all(torch.equal(o, outs[0]) for o in outs), "split tiles changed the bits"
    gate_w = torch.randn(E * 8, D, device=DEVICE)
    logits = [torch.empty(B, E * 8, device=DEVICE) for _ in range(3)]
    for lo, c in zip(logits, (dict(BLOCK_E=16, BLOCK_K=128), dict(BLOCK_E=32, BLOCK_K=64), dict(BLOCK_E=16, BLOCK_K=256))):
        moe_route(x, gate_w, None, k, config=moe.DEFAULT_ROUTER | c, logits_out=lo)
    assert all(torch.equal(lo, logits[0]) for lo in logits), "router dot tiles changed the bits"


# --------------------------------------------------------------------------- plan
def _plan(tmp_path, entries, name="plan.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"meta": {}, "entries": entries}) if not isinstance(entries, str) else entries)
    return p


@pytest.fixture
def plan_at(monkeypatch):
    def use(path):
        monkeypatch.setattr(moe, "PLAN_PATH", path)
        moe.clear_plan_cache()
    yield use
    moe.clear_plan_cache()


def test_plan_missing_or_unreadable_gives_defaults(tmp_path, plan_at):
    plan_at(tmp_path / "absent.json")
    assert moe.router_config(256, 2304, BF16, 1) == moe.DEFAULT_ROUTER
    assert moe.experts_config(256, 2304, 1024, 8, BF16, 8) == moe.DEFAULT_EXPERTS
    plan_at(_plan(tmp_path, "{not json"))
    with pytest.warns(UserWarning, match="unreadable"):
        assert moe.experts_config(256, 2304, 1024, 8, BF16, 1) == moe.DEFAULT_EXPERTS


def test_plan_picks_bucket_and_rejects_bad_entries(tmp_path, plan_at):
    fused = dict(variant="fused", BLOCK_I=32, BLOCK_D=128, BLOCK_DO=128, num_warps=4, num_stages=3)
    big = moe.DEFAULT_EXPERTS | dict(DOWN_BLOCK_D=128)
    ekey, rkey = moe.experts_key(8, 64, 32, 2, F32), moe.router_key(8, 64, F32)
    bad_key = moe.experts_key(8, 64, 32, 4, F32)
    plan_at(_plan(tmp_path, {
        ekey: {"B": {"1": fused | {"measured": {"time_ms": 0.01}}, "4": big, "16": big}},
        rkey: {"B": {"2": dict(moe.DEFAULT_ROUTER, BLOCK_E=8)}},  # a dot tile below 16: invalid
        bad_key: {"B": {"1": dict(fused, BLOCK_I=24)}},        # not a power of two
    }))
    assert moe.experts_config(8, 64, 32, 2, F32, 1) == fused  # "measured" is dropped
    assert moe.experts_config(8, 64, 32, 2, F32, 3) == big    # next tuned B up
    assert moe.experts_config(8, 64, 32, 2, F32, 40) == big   # past the largest: the largest
    with pytest.warns(UserWarning, match="malformed"):
        assert moe.router_config(8, 64, F32, 2) == moe.DEFAULT_ROUTER
    with pytest.warns(UserWarning, match="malformed"):
        assert moe.experts_config(8, 64, 32, 4, F32, 1) == moe.DEFAULT_EXPERTS
    assert moe.experts_config(8, 64, 32, 2, BF16, 1) == moe.DEFAULT_EXPERTS  # other dtype: not in the plan
    # and the kernels run with what the plan picked
    w13, w2 = make_weights(64, 32, 8, F32, seed=2)
    ids, w = make_routing(3, 8, 2, "random", seed=2)
    x = make_x(3, 64, F32, seed=2)
    assert_close(moe_experts(x, w13, w2, ids, w), experts_ref(x, w13, w2, ids, w, "swiglu"), TOL[F32])


def test_committed_plan_entries_valid():
    raw = json.loads(moe.PLAN_PATH.read_text()) if moe.PLAN_PATH.exists() else {"entries": {}}
    for key, entry in raw["entries"].items():
        kind = key.split(",")[0]
        valid = moe.valid_router if kind == "router" else moe.valid_experts
        classes = set()
        for b, cfg in entry["B"].items():
            assert valid({k: v for k, v in cfg.items() if k != "measured"}), (key, b)
            assert cfg["measured"]["time_ms"] > 0, (key, b)  # every entry carries the timing that chose it
            classes.add(moe.order_class(cfg))
        assert len(classes) == 1, f"{key}: one order class for every B, or tokens change bits with B"


def test_defaults_are_valid():
    assert moe.valid_router(moe.DEFAULT_ROUTER) and moe.valid_experts(moe.DEFAULT_EXPERTS)
    for cfg in list(ROUTER_VARIANTS.values()):
        assert moe.valid_router(cfg)
    for cfg in EXPERT_VARIANTS.values():
        assert moe.valid_experts(cfg)
    assert not moe.valid_experts(moe.DEFAULT_EXPERTS | {"SWAP": "yes"})
    assert not moe.valid_experts(moe.DEFAULT_EXPERTS | {"up_stages": 0})
    assert not moe.valid_router(moe.DEFAULT_ROUTER | {"CHUNK": 64, "BLOCK_K": 128})  # chunk < tile


# --------------------------------------------------------------------------- tuner selection logic
def test_tuner_choose_one_group_for_all_batches():
    from peregrine.bench.kernels_moe import choose
    recs = [
        {"group": "a", "times_ms": {1: 1.0, 8: 9.0}},
        {"group": "a", "times_ms": {1: 2.0, 8: 5.0}},
        {"group": "b", "times_ms": {1: 0.5}},            # fastest at B=1 but never passed at B=8
        {"group": "c", "times_ms": {1: 1.5, 8: 5.4}},    # one config: total 6.9 > a's best-per-B 6.0
        {"skipped": "OutOfResources", "times_ms": {}},
    ]
    assert choose(recs, (1, 8)) == ("a", {1: 0, 8: 1})
    recs[3]["times_ms"] = {1: 0.9, 8: 4.9}
    assert choose(recs, (1, 8)) == ("c", {1: 3, 8: 3})
    assert choose(recs[4:], (1, 8)) == (None, {})


def test_tuner_smoke_on_cpu(monkeypatch):
    """The whole tune path (probe bits, reference checks, grouping, invariance check) on tiny shapes,
    with a fake clock; a config that cannot run is skipped, not fatal."""
    from peregrine.bench import kernels_moe as km
    if DEVICE != "cpu":
        pytest.skip("the GPU pass runs the real tuner")
    for name, v in dict(DEVICE="cpu", D=64, I=32, E=8, TOP_K=2, REPS=2, DTYPE=F32).items():
        monkeypatch.setattr(km, name, v)
    monkeypatch.setattr(km, "ROUTER_CANDS", [ROUTER_VARIANTS["fma"], moe.DEFAULT_ROUTER | {"BLOCK_E": 8}])
    monkeypatch.setattr(km, "UP_CANDS", [dict(UP_BLOCK_I=16, UP_BLOCK_D=32, up_warps=4, up_stages=2)])
    monkeypatch.setattr(km, "DOWN_CANDS", [dict(DOWN_BLOCK_D=16, DOWN_BLOCK_I=16, SWAP=True, down_warps=4,
                                                down_stages=2)])
    monkeypatch.setattr(km, "FUSED_CANDS", [EXPERT_VARIANTS["fused"]])
    fake = {"fused": 1.0, "split": 2.0}
    monkeypatch.setattr(km.Family, "time", lambda self, cfg, case: fake.get(cfg["variant"], 3.0) + case.B)
    res = km.tune(1000.0, bs=(1, 3), budget_s=600, log=lambda *a: None)
    ents = res["entries"]
    rkey = [k for k in ents if k.startswith("router")][0]
    ekey = [k for k in ents if k.startswith("experts")][0]
    assert ents[ekey]["B"]["1"]["variant"] == "fused" and ents[ekey]["batch_invariant"] == "yes"
    assert ents[rkey]["B"]["3"]["variant"] == "fma"
    assert "AssertionError" in res["records"]["router"][1]["skipped"]  # BLOCK_E 8 cannot feed tl.dot
    only = km.tune(1000.0, bs=(1, 3), budget_s=600, log=lambda *a: None, router_only=True)  # --router-only
    assert list(only["entries"]) == [rkey] and only["records"]["experts"] == []
    assert only["entries"][rkey]["B"] == ents[rkey]["B"]


def test_tuner_shared_slot_tunes_its_own_entry(monkeypatch, tmp_path):
    """--shared: the experts are checked against a reference that holds the shared expert as expert E,
    tuned under their own '+shared' key (no router sweep), and that entry is what the shared-slot
    launches read; a plan without it leaves them on the routed-only entry."""
    from peregrine.bench import kernels_moe as km
    if DEVICE != "cpu":
        pytest.skip("the GPU pass runs the real tuner")
    for name, v in dict(DEVICE="cpu", D=64, I=32, E=8, TOP_K=2, REPS=2, DTYPE=F32, SHARED=True).items():
        monkeypatch.setattr(km, name, v)
    monkeypatch.setattr(km, "UP_CANDS", [])
    monkeypatch.setattr(km, "DOWN_CANDS", [])
    monkeypatch.setattr(km, "FUSED_CANDS", [EXPERT_VARIANTS["fused"]])
    monkeypatch.setattr(km.Family, "time", lambda self, cfg, case: {"fused": 1.0}.get(cfg["variant"], 3.0) + case.B)
    res = km.tune(1000.0, bs=(1, 3), budget_s=600, log=lambda *a: None)
    assert res["records"]["router"] == []
    key = moe.experts_key(8, 64, 32, 2, F32, shared=True)
    assert list(res["entries"]) == [key] and key.split(",")[4] == "2+shared"
    assert all("group" in r for r in res["records"]["experts"]), res["records"]["experts"]  # all agreed with the ref
    assert res["entries"][key]["B"]["1"]["variant"] == "fused"
    plain = moe.experts_key(8, 64, 32, 2, F32)
    plan = tmp_path / "plan.json"
    monkeypatch.setattr(moe, "PLAN_PATH", plan)
    split_cfg = moe.DEFAULT_EXPERTS | {"UP_BLOCK_I": 16}
    for entries, want in (({plain: {"B": {"1": split_cfg}}}, split_cfg["UP_BLOCK_I"]),
                          ({plain: {"B": {"1": split_cfg}}, key: res["entries"][key]}, None)):
        plan.write_text(json.dumps({"entries": entries}))
        moe.clear_plan_cache()
        cfg = moe.experts_config(8, 64, 32, 2, F32, 1, shared=True)
        assert (cfg.get("UP_BLOCK_I") == want) if want else cfg["variant"] == "fused"
        assert moe.experts_config(8, 64, 32, 2, F32, 1) == {k: v for k, v in split_cfg.items()}
    moe.clear_plan_cache()


# --------------------------------------------------------------------------- compiled code (no GPU needed)
def test_every_variant_compiles_for_sm90_without_spills():
    """The interpreter cannot catch compile errors: compile each variant for sm_90 (ptxas included)."""
    code = ("import json; from peregrine.bench import kernels_moe as km; from peregrine.kernels import moe; "
            f"print(json.dumps(km.compile_check([moe.DEFAULT_ROUTER, {ROUTER_VARIANTS['fma']!r}], "
            f"[moe.DEFAULT_EXPERTS, moe.DEFAULT_EXPERTS | {{'SWAP': True}}, {EXPERT_VARIANTS['fused_wide']!r}])))")
    rows = run_aot(code, timeout=600)
    assert len(rows) == 1 + 2 * 3 + 2 * 2 + 1  # combine, (logits, logits+top-k, top-k) x 2, (up + down) x 2, fused
    for row in rows:
        assert "error" not in row, row
        assert row["spill"] == 0 and 0 < row["regs"] <= 255, row
    downs = {"'SWAP': True" in row["kernel"]: row for row in rows if row["kernel"].startswith("down")}
    assert downs[True]["wgmma"] > 0, "the swapped down tile (64 weight rows as M) should use wgmma"
    assert downs[False]["mma"] > 0 and downs[False]["cp_async"] > 0, "down: tensor cores fed by pipelined copies"
    # software-pipelined weight loads: shared memory for two stages' tiles or more (one stage: a
    # weight address the compiler could not prove aligned, which cost the experts 2x on the H200)
    d = moe.DEFAULT_EXPERTS
    up = next(row for row in rows if row["kernel"].startswith("up") and "'SWAP': True" not in row["kernel"])
    assert up["smem"] >= 2 * 2 * (moe.B_MAX + 2 * d["UP_BLOCK_I"]) * d["UP_BLOCK_D"], up
    assert downs[False]["smem"] >= 2 * 2 * (moe.B_MAX + d["DOWN_BLOCK_D"]) * d["DOWN_BLOCK_I"], downs[False]
