"""One KDA decoder layer with its MoE block as a task list: the work a persistent decode kernel runs per step.

Each task streams one tile of weights (in-projection column tiles, a head's gate and recurrence, output-projection
tiles, the router, an expert assignment's up / down tiles, shared-expert tiles, combine tiles) and declares the
regions of the step's scratch it reads and writes. Dependencies are derived from those regions (a reader waits for
every task that writes an overlapping region), so a kernel's dependency counters and this module agree by
construction; the emulator (persistent/emulator.py) checks that the declarations suffice by running the tasks in
random orders they allow, against the chain (`chain` below: the same math as whole tensors, each kernel's FP32
reference, docs/models.md).

The routed experts follow kernels/moe.py's schedule: assignment j (token b = j // k, slot j % k) does its expert's
work only when it is the expert's first assignment, for every token that chose it; its down tiles read only its own
up tiles, so the graph is static although the routing is not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels.kda import kda_decode_ref
from ..kernels.moe import act_ref, moe_experts_ref, moe_route_ref, moe_select_ref

EPS_QK = 1e-6  # kda_decode_ref's q/k norm epsilon


@dataclass
class LayerWeights:
    """FP32 weights of one KDA + MoE decoder layer (shapes as models/kda.py and models/moe.py hold them)."""
    in_norm: torch.Tensor            # [D]
    in_proj: torch.Tensor            # [3Hd + r + r + H, D]: q | k | v | f_a | g_a | b
    f_b: torch.Tensor                # [Hd, r]
    g_b: torch.Tensor                # [Hd, r]
    conv_w: torch.Tensor             # [3Hd, W]
    A_log: torch.Tensor              # [H]
    dt_bias: torch.Tensor            # [Hd]
    o_norm: torch.Tensor             # [d]
    o_proj: torch.Tensor             # [D, Hd]
    post_norm: torch.Tensor          # [D]
    gate_w: torch.Tensor             # [E, D]
    bias: torch.Tensor               # [E]
    w13: torch.Tensor                # [E, 2I, D]
    w2: torch.Tensor                 # [E, D, I]
    shared13: torch.Tensor           # [2Is, D]
    shared2: torch.Tensor            # [D, Is]
    H: int
    d: int
    top_k: int
    eps: float = 1e-5
    lower_bound: float | None = None  # KDA gate: softplus (None) or bounded

    @property
    def splits(self) -> list[int]:
        H, d, r = self.H, self.d, self.f_b.shape[1]
        return [3 * H * d, r, r, H]


@dataclass(frozen=True)
class Region:
    buf: str
    lo: int
    hi: int

    def overlaps(self, o: "Region") -> bool:
        return self.buf == o.buf and self.lo < o.hi and o.lo < self.hi


@dataclass
class Task:
    name: str
    fn: Callable[[dict], None]
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    nbytes: int                      # weight bytes it streams (the schedule's cost)
    deps: list[int] = field(default_factory=list)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def scratch(w: LayerWeights, B: int) -> dict:
    """The step's scratch, NaN-poisoned (ids -1): a task that reads a region before its writer ran sees NaN."""
    D, P, Hd = w.in_proj.shape[1], w.in_proj.shape[0], w.H * w.d
    E, I2, _ = w.w13.shape
    nan = lambda *s: torch.full(s, float("nan"))  # noqa: E731
    return {"h": nan(B, D), "proj": nan(B, P), "f": nan(B, Hd), "r": nan(B, Hd), "o": nan(B, Hd), "a": nan(B, D),
            "resid2": nan(B, D), "h2": nan(B, D), "logits": nan(B, E), "ids": torch.full((B, w.top_k), -1), "tw": nan(B, w.top_k),
            "hbuf": nan(B, w.top_k, I2 // 2), "part": nan(B, w.top_k, D), "sh": nan(B, w.shared2.shape[1]),
            "shout": nan(B, D), "out": nan(B, D)}


def build(w: LayerWeights, B: int, tile: int = 64) -> list[Task]:
    """The layer's tasks for B tokens, columns in tiles of `tile`; deps derived from the declared regions.
    Inputs outside the scratch (resid, the KDA state, conv state, slots) live in the dict under those names."""
    D, P = w.in_proj.shape[1], w.in_proj.shape[0]
    H, d, r, k = w.H, w.d, w.f_b.shape[1], w.top_k
    Hd = H * d
    E, I2, _ = w.w13.shape
    I, Is = I2 // 2, w.shared2.shape[1]
    off_f, off_g, off_b = 3 * Hd, 3 * Hd + r, 3 * Hd + 2 * r
    nb = lambda t: t.numel() * 2  # noqa: E731  BF16 bytes on the GPU
    R = Region
    tasks: list[Task] = []

    def add(name, fn, reads, writes, nbytes=0):
        tasks.append(Task(name, fn, tuple(reads), tuple(writes), nbytes))

    def norm_in(s):
        s["h"][:] = _rms(s["resid"], w.in_norm, w.eps)
    add("norm_in", norm_in, [R("resid", 0, D)], [R("h", 0, D)])
    for lo in range(0, P, tile):
        hi = min(P, lo + tile)

        def in_proj(s, lo=lo, hi=hi):
            s["proj"][:, lo:hi] = s["h"] @ w.in_proj[lo:hi].T
        add(f"in_proj[{lo}]", in_proj, [R("h", 0, D)], [R("proj", lo, hi)], nb(w.in_proj[lo:hi]))
    for h in range(H):
        c = slice(h * d, (h + 1) * d)

        def gates(s, c=c):
            s["f"][:, c] = s["proj"][:, off_f:off_f + r] @ w.f_b[c].T
            s["r"][:, c] = s["proj"][:, off_g:off_g + r] @ w.g_b[c].T
        add(f"gates[{h}]", gates, [R("proj", off_f, off_g + r)], [R("f", c.start, c.stop), R("r", c.start, c.stop)],
            nb(w.f_b[c]) + nb(w.g_b[c]))

        def kda(s, h=h, c=c):
            cols = torch.cat([torch.arange(c.start, c.stop) + j * Hd for j in range(3)])  # q, k, v of head h
            st = s["state"][:, h:h + 1]
            cs = s["conv_state"][:, :, cols]
            o = kda_decode_ref(s["proj"][:, None, cols], s["f"][:, None, c], s["proj"][:, None, off_b + h:off_b + h + 1],
                               s["r"][:, None, c], w.conv_w[cols], w.A_log[h:h + 1], w.dt_bias[c], w.o_norm, st, cs,
                               s["slots"], gate="softplus" if w.lower_bound is None else "bounded",
                               lower_bound=-5.0 if w.lower_bound is None else w.lower_bound, eps_qk=EPS_QK, eps_o=w.eps)
            s["state"][:, h:h + 1] = st
            s["conv_state"][:, :, cols] = cs
            s["o"][:, c] = o[:, 0]
        reads = [R("proj", c.start + j * Hd, c.stop + j * Hd) for j in range(3)]
        reads += [R("proj", off_b + h, off_b + h + 1), R("f", c.start, c.stop), R("r", c.start, c.stop)]
        add(f"kda[{h}]", kda, reads, [R("o", c.start, c.stop), R(f"state{h}", 0, 1)], nb(w.conv_w[c]) * 3)
    for lo in range(0, D, tile):
        hi = min(D, lo + tile)

        def o_proj(s, lo=lo, hi=hi):
            s["a"][:, lo:hi] = s["o"] @ w.o_proj[lo:hi].T
        add(f"o_proj[{lo}]", o_proj, [R("o", 0, Hd)], [R("a", lo, hi)], nb(w.o_proj[lo:hi]))

    def norm_post(s):
        s["resid2"][:] = s["resid"] + s["a"]
        s["h2"][:] = _rms(s["resid2"], w.post_norm, w.eps)
    add("norm_post", norm_post, [R("resid", 0, D), R("a", 0, D)], [R("resid2", 0, D), R("h2", 0, D)])

    for lo in range(0, E, tile):  # router logits in expert tiles, then one top-k
        hi = min(E, lo + tile)

        def logits(s, lo=lo, hi=hi):
            s["logits"][:, lo:hi] = s["h2"] @ w.gate_w[lo:hi].T
        add(f"logits[{lo}]", logits, [R("h2", 0, D)], [R("logits", lo, hi)], nb(w.gate_w[lo:hi]))

    def router(s):
        ids, tw = moe_select_ref(s["logits"], w.bias, k)
        s["ids"][:], s["tw"][:] = ids, tw
    add("router", router, [R("logits", 0, E)], [R("ids", 0, 1)])
    for lo in range(0, Is, tile):
        hi = min(Is, lo + tile)

        def shared_up(s, lo=lo, hi=hi):
            s["sh"][:, lo:hi] = act_ref(s["h2"] @ w.shared13[lo:hi].T, s["h2"] @ w.shared13[Is + lo:Is + hi].T)
        add(f"shared_up[{lo}]", shared_up, [R("h2", 0, D)], [R("sh", lo, hi)], 2 * nb(w.shared13[lo:hi]))
    for lo in range(0, D, tile):
        hi = min(D, lo + tile)

        def shared_down(s, lo=lo, hi=hi):
            s["shout"][:, lo:hi] = s["sh"] @ w.shared2[lo:hi].T
        add(f"shared_down[{lo}]", shared_down, [R("sh", 0, Is)], [R("shout", lo, hi)], nb(w.shared2[lo:hi]))

    def first_use(s, j):
        flat = s["ids"].flatten()
        e = int(flat[j])
        return e, bool((flat[:j] != e).all())

    def chose(s, e):
        return [(b, int((s["ids"][b] == e).nonzero()[0])) for b in range(B) if bool((s["ids"][b] == e).any())]
    for j in range(B * k):
        for lo in range(0, I, tile):
            hi = min(I, lo + tile)

            def up(s, j=j, lo=lo, hi=hi):
                e, first = first_use(s, j)
                if first:
                    for b, slot in chose(s, e):
                        x = s["h2"][b]
                        s["hbuf"][b, slot, lo:hi] = act_ref(w.w13[e, lo:hi] @ x, w.w13[e, I + lo:I + hi] @ x)
            add(f"up[{j},{lo}]", up, [R("h2", 0, D), R("ids", 0, 1)], [R(f"hbuf{j}", lo, hi)],
                2 * nb(w.w13[0, lo:hi]))
        for lo in range(0, D, tile):
            hi = min(D, lo + tile)

            def down(s, j=j, lo=lo, hi=hi):
                e, first = first_use(s, j)
                if first:
                    for b, slot in chose(s, e):
                        s["part"][b, slot, lo:hi] = w.w2[e, lo:hi] @ s["hbuf"][b, slot]
            add(f"down[{j},{lo}]", down, [R(f"hbuf{j}", 0, I), R("ids", 0, 1)], [R(f"part{j}", lo, hi)],
                nb(w.w2[0, lo:hi]))
    for lo in range(0, D, tile):
        hi = min(D, lo + tile)

        def combine(s, lo=lo, hi=hi):
            routed = (s["part"][:, :, lo:hi] * s["tw"][:, :, None]).sum(1)
            s["out"][:, lo:hi] = s["resid2"][:, lo:hi] + routed + s["shout"][:, lo:hi]
        reads = [R("resid2", lo, hi), R("shout", lo, hi), R("ids", 0, 1)] + [R(f"part{j}", lo, hi) for j in range(B * k)]
        add(f"combine[{lo}]", combine, reads, [R("out", lo, hi)])
    derive_deps(tasks)
    return tasks


def derive_deps(tasks: list[Task]) -> None:
    """Each task depends on every earlier task that writes a region overlapping one it reads (the list is in a
    valid order: a region's writers come before its readers)."""
    for i, t in enumerate(tasks):
        t.deps = sorted({p for p in range(i) for rd in t.reads for wr in tasks[p].writes if rd.overlaps(wr)})


def chain(w: LayerWeights, resid, state, conv_state, slots) -> torch.Tensor:
    """The layer as the specialized path computes it, whole tensors through each kernel's FP32 reference:
    the output residual; state and conv_state updated in place."""
    h = _rms(resid, w.in_norm, w.eps)
    proj = h @ w.in_proj.T
    qkv, fa, ga, b = proj.split(w.splits, -1)
    f, r = fa @ w.f_b.T, ga @ w.g_b.T
    o = kda_decode_ref(qkv[:, None], f[:, None], b[:, None], r[:, None], w.conv_w, w.A_log, w.dt_bias, w.o_norm,
                       state, conv_state, slots, gate="softplus" if w.lower_bound is None else "bounded",
                       lower_bound=-5.0 if w.lower_bound is None else w.lower_bound, eps_qk=EPS_QK, eps_o=w.eps)[:, 0]
    resid2 = resid + o @ w.o_proj.T
    h2 = _rms(resid2, w.post_norm, w.eps)
    ids, tw = moe_route_ref(h2, w.gate_w, w.bias, w.top_k)
    Is = w.shared2.shape[1]
    shared = act_ref(h2 @ w.shared13[:Is].T, h2 @ w.shared13[Is:].T) @ w.shared2.T
    return resid2 + moe_experts_ref(h2, w.w13, w.w2, ids, tw) + shared


def from_layer(layer, cfg) -> LayerWeights:
    """The LayerWeights of a model's KDA + MoE decoder layer (models/kimi.py's DecoderLayer), as FP32 views of its
    parameters: what a persistent layer is built from. Refuses what the task list does not cover."""
    attn, mlp = layer.attn, layer.mlp
    why = ("not a KDA layer" if not layer.is_kda else "not a MoE layer" if not layer.is_moe
           else "MXFP4 experts" if mlp.mx else "a latent MoE (K3)" if mlp.latent
           else "a full-rank output gate (K3)" if attn.g_b is None else "AttnRes blocks (K3)" if layer.res
           else "no shared expert" if mlp.shared is None else "the router is not renormalized"
           if not cfg.moe_renormalize else None)
    if why:
        raise ValueError(f"a persistent layer covers Kimi-Linear's KDA + MoE layers: this one has {why}")
    f = lambda t: t.detach().float()  # noqa: E731
    return LayerWeights(
        in_norm=f(layer.input_layernorm.weight), in_proj=f(attn.in_proj), f_b=f(attn.f_b), g_b=f(attn.g_b),
        conv_w=f(attn.conv_w), A_log=f(attn.A_log), dt_bias=f(attn.dt_bias), o_norm=f(attn.o_norm),
        o_proj=f(attn.o_proj), post_norm=f(layer.post_attention_layernorm.weight), gate_w=f(mlp.gate_w),
        bias=f(mlp.bias), w13=f(mlp.w13), w2=f(mlp.w2), shared13=f(mlp.shared.gate_up), shared2=f(mlp.shared.down),
        H=attn.H, d=attn.d, top_k=cfg.num_experts_per_token, eps=cfg.rms_norm_eps, lower_bound=cfg.kda_gate_lower_bound)
