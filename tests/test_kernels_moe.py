"""Fused MoE decode kernels vs independent FP32 references (VERIFY.md §1).

CPU (interpreter): tiny and odd shapes. GPU pass: also the real Kimi-Linear shapes.
The "each expert read once" design is proven indirectly: duplicate-heavy routings
(all tokens on the same experts) must give the same answer as the per-token loop,
which they only can if the one working program serves every token that chose e.
"""
import pytest
import torch

from peregrine.kernels import available
from peregrine.kernels.moe import moe_experts, moe_forward, moe_route
from peregrine.testing import assert_close, poisoned
from conftest import DEVICE, FULL_SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
W_TOL = 1e-6  # router weights: FP32 math on both sides
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # MODELS.md, restated here so the reference is independent
REAL = dict(D=2304, I=1024, E=256, k=8)  # kimi-linear-48b-a3b
TINY = dict(D=256, I=128, E=16, k=4)     # tiny-kimi-linear
ODD = dict(D=100, I=48, E=5, k=2)        # nothing a multiple of a tile


# --------------------------------------------------------------------------- references (FP32, from MODELS.md)
def route_ref(x, gate_w, bias, k, renormalize, scaling):
    s = torch.sigmoid(x.double() @ gate_w.double().t()).float()
    order = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices  # ties: lowest index
    ids = order[:, :k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling


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
def make_weights(D, I, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    return w13.to(DEVICE), w2.to(DEVICE)


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
F32, BF16 = torch.float32, torch.bfloat16
ROUTER_CASES = [(1, TINY, 1, F32), (3, ODD, 2, BF16), (16, TINY, 3, F32), (16, TINY, 3, BF16), (7, REAL, 4, BF16)]
if FULL_SHAPES:
    ROUTER_CASES += [(B, REAL, 10 + B, dt) for B in (1, 2, 4, 8, 16) for dt in (F32, BF16)]


@pytest.mark.parametrize("B,shape,seed,dtype", ROUTER_CASES)
def test_route_matches_reference(B, shape, seed, dtype):
    D, E, k = shape["D"], shape["E"], shape["k"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g).to(dtype).to(DEVICE)
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).to(dtype).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.05).to(DEVICE)
    ids, w = moe_route(x, gate_w, bias, k, renormalize=True, scaling=2.446)
    rid, rw = route_ref(x, gate_w, bias, k, True, 2.446)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long().sort(-1).values, rid.sort(-1).values), "chosen expert sets differ"
    order = ids.long().argsort(-1)  # compare weights expert by expert
    got = w.gather(1, order)
    want = rw.gather(1, rid.argsort(-1))
    assert (got - want).abs().max().item() <= W_TOL * 2.446


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
    assert torch.allclose(w, (s * 1.5)[:, None].expand(2, k), atol=W_TOL, rtol=0)
    bias[4] = 1.0  # a bias moves expert 4 to the front, but its weight stays σ(logit) (not s + bias)
    ids, w = moe_route(x, gate_w, bias, k, renormalize=False, scaling=1.0)
    assert ids.tolist() == [[4, 0, 1], [4, 0, 1]]
    assert torch.allclose(w, s[:, None].expand(2, k), atol=W_TOL, rtol=0)


# --------------------------------------------------------------------------- experts
# (B, shape, dtype, activation, routing kind, down path)
EXPERT_CASES = [
    (1, TINY, torch.bfloat16, "swiglu", "random", "fused"),
    (3, ODD, torch.float32, "situ", "random", "fused"),
    (7, ODD, torch.bfloat16, "swiglu", "same", "fused"),
    (16, TINY, torch.float32, "swiglu", "same", "fused"),
    (4, TINY, torch.float32, "situ", "distinct", "fused"),
    (2, ODD, torch.bfloat16, "situ", "distinct", "partials"),
    (7, TINY, torch.float32, "swiglu", "random", "partials"),
]
if FULL_SHAPES:
    EXPERT_CASES += [(B, REAL, torch.bfloat16, "swiglu", kind, down)
                     for B in (1, 2, 4, 8, 16) for kind in ("random", "same") for down in ("fused", "partials")]
    EXPERT_CASES += [(B, REAL, torch.bfloat16, "situ", "random", "fused") for B in (1, 8)]


def _case_id(c):
    B, shape, dtype, act, kind, down = c
    return f"B{B}-D{shape['D']}-I{shape['I']}-E{shape['E']}-k{shape['k']}-{str(dtype)[6:]}-{act}-{kind}-{down}"


@pytest.mark.parametrize("case", EXPERT_CASES, ids=_case_id)
def test_experts_match_reference(case):
    B, shape, dtype, act, kind, down = case
    D, I, E, k = shape["D"], shape["I"], shape["E"], shape["k"]
    w13, w2 = make_weights(D, I, E, dtype, seed=B)
    ids, w = make_routing(B, E, k, kind, seed=B)
    x = make_x(B, D, dtype, seed=B, strided=B % 2 == 1)
    out = poisoned((B, D), dtype, DEVICE)
    ws = poisoned((B, k, I), torch.float32, DEVICE)  # every (token, slot) row must be written before read
    res = moe_experts(x, w13, w2, ids, w, activation=act, out=out, workspace=ws, down=down)
    assert res is out and res.dtype == dtype
    assert torch.isfinite(ws).all(), "a (token, slot) activation row was never written"
    assert_close(out, experts_ref(x, w13, w2, ids, w, act), TOL[dtype], f"moe_experts {_case_id(case)}")


def test_experts_bitwise_reproducible_and_batch_invariant():
    B, D, I, E, k = 5, 100, 48, 16, 4  # small: four calls under the interpreter
    w13, w2 = make_weights(D, I, E, torch.bfloat16, seed=7)
    ids, w = make_routing(B, E, k, "random", seed=7)
    ids[1] = ids[0]  # a shared expert set, so the batch changes who does the work
    x = make_x(B, D, torch.bfloat16, seed=7)
    a = moe_experts(x, w13, w2, ids, w)
    b = moe_experts(x, w13, w2, ids, w)
    assert torch.equal(a, b), "two runs on the same inputs differ: a race or an order-dependent combine"
    alone = moe_experts(x[1:2], w13, w2, ids[1:2].contiguous(), w[1:2])
    assert torch.equal(alone[0], a[1]), "a token's output depends on the rest of its batch"
    part = moe_experts(x, w13, w2, ids, w, down="partials")
    assert_close(part, a.float(), 1e-3, "partials vs fused down path")


def test_forward_end_to_end():
    B, D, I, E, k = 3, TINY["D"], TINY["I"], TINY["E"], TINY["k"]
    w13, w2 = make_weights(D, I, E, torch.float32, seed=11)
    g = torch.Generator().manual_seed(11)
    gate_w = (torch.randn(E, D, generator=g) / D**0.5).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.05).to(DEVICE)
    x = make_x(B, D, torch.float32, seed=11)
    out = moe_forward(x, gate_w, bias, w13, w2, k, True, 2.446)
    rid, rw = route_ref(x, gate_w, bias, k, True, 2.446)
    assert_close(out, experts_ref(x, w13, w2, rid, rw, "swiglu"), TOL[torch.float32], "moe_forward")
