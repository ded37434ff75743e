"""KDA (Kimi Delta Attention): gated delta-rule linear attention, FP32 state.

The recurrent form here is the reference for both prefill and decode
(docs/models.md "KDA layer"); decode sequences of a step are processed together,
prefill sequences one at a time over their tokens: long ones in the chunked form, on the GPU
through flash-linear-attention's chunk_kda (fla-core) when it is installed, and short ones on the GPU
through the one-kernel recurrence of kernels/kda.py (the decode kernel, which takes any T).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import INVARIANT_ALIGN, ModelConfig
from .layers import HFParam, linear, param, rms_norm, split_rows

QK_NORM_EPS = 1e-6  # eps of the q/k L2 norms (docs/models.md)
CHUNK = 32  # KDA chunk: the intra-chunk [C, C, K] decay tensor grows with C, the chunk count shrinks
CHUNKED_MIN_TOKENS = 64  # prefill chunks at least this long use the chunked form (no per-token loop)
CONV1D_MIN_TOKENS = 64  # rows this long run the short conv as conv1d: unfold would materialise [T, C, W]
SHORT_ROW_MAX_TOKENS = 128  # GPU prefill rows up to this long take the one-kernel recurrence: serial in T, but one
#   launch against fla's ~1.8 ms of host work per call (bench kda_rows, H200: a 48B layer 0.61 vs 1.82 ms at 128
#   tokens, even at 512; the margin kept for steps whose other layers keep the GPU busy); longer rows take fla
FLA_TAIL_MIN_TOKENS = 8192  # rows this long run their tail after the last snapshot cut through fla too: the second
#   call's host work hides behind the row's GPU work, and the recurrence kernel is serial in T (H200, 48B: a
#   64-token tail 0.25 ms a layer, 5 ms of a cold 32K prompt)
SHORT_ROWS_KERNEL: bool | None = None  # None: on the GPU outside FP32 runs (as fla); True: also on the CPU
#                                         under the interpreter (tests); False: never
CONV_KERNEL = True  # fla rows' short conv, L2 norms and q/k/v split in one pass (kernels/kda_conv.py) wherever the
#   kernels run (the GPU; the CPU under the interpreter); False: fla's conv and copies (A/B)
VARLEN_BOUNDED_GATE = False  # K3's bounded gate in that shared call too: off until its GPU case
#   (test_gpu_kda_rows_of_one_step_share_a_varlen_fla_call[k3-shared]) has passed


def fla_ops():
    """fla-core's Triton ops for a KDA prefill on the GPU (chunk_kda with the gate, beta and q/k L2 norms
    fused in, the short conv with SiLU, the gated RMSNorm), or None where fla is not installed."""
    global _FLA
    if _FLA is None:
        try:
            from types import SimpleNamespace

            from fla.modules.causal_conv1d import causal_conv1d
            from fla.modules.fused_norm_gate import rms_norm_gated
            from fla.ops.kda import chunk_kda as ck
            _FLA = SimpleNamespace(chunk_kda=ck, causal_conv1d=causal_conv1d, rms_norm_gated=rms_norm_gated)
        except Exception:  # not installed, or an incompatible build: the torch chunked form serves
            _FLA = False
    return _FLA or None


_FLA = None


def causal_conv(x_ext: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU. x_ext [B, W-1+T, C] (state then new inputs), w [C, W] -> [B, T, C] FP32."""
    W = w.shape[1]
    if x_ext.shape[1] - (W - 1) >= CONV1D_MIN_TOKENS and not kernels.batch_invariant():  # (the mode: one form, any T)
        y = F.conv1d(x_ext.float().transpose(1, 2), w.float().unsqueeze(1), groups=w.shape[0])  # [B, C, T]
        return F.silu(y.transpose(1, 2))
    win = x_ext.float().unfold(1, W, 1)  # [B, T, C, W], tap j is input t-(W-1)+j
    return F.silu((win * w.float()).sum(-1))


def l2norm(x: torch.Tensor, eps: float = QK_NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, H: int, lower_bound: float | None) -> torch.Tensor:
    """Log-space decay per key channel, [..., H, d]."""
    f = (f.float() + dt_bias.float()).unflatten(-1, (H, -1))
    a = torch.exp(A_log.float()).view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(f)
    return lower_bound * torch.sigmoid(a * f)


def delta_step(S: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """One token for a batch of heads, in place on S [B, H, K, V]; q,k,g [B,H,K], v [B,H,V], beta [B,H]."""
    S.mul_(torch.exp(g).unsqueeze(-1))
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", S, q)


def chunk_kda(q, k, v, g, beta, S0=None, chunk: int = CHUNK):
    """Gated delta rule over whole sequences, chunk by chunk; equals the recurrence
    S ← diag(exp g_t) S; u = β_t (v_t − Sᵀk_t); S ← S + k_t u_tᵀ; o_t = Sᵀq_t.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; S0 [B, H, K, V] or None.
    Returns o [B, T, H, V] and the final state, FP32.

    Within a chunk, with G_t the inclusive cumulative log-decay (per key channel):
      u = (I + A)⁻¹ (βv − β (e^{G}⊙k) S0),  A[t,s] = β_t Σ_c k_t k_s e^{G_t − G_s}  (s < t)
      o_t = (e^{G_t}⊙q_t) S0 + Σ_{s≤t} (Σ_c q_t k_s e^{G_t − G_s}) u_s
      S_end = e^{G_C} ⊙ S0 + Σ_s (e^{G_C − G_s}⊙k_s) u_sᵀ
    Every exponent is ≤ 0 (pairwise differences are masked to s ≤ t), so strong
    decays underflow to 0 instead of overflowing.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    chunk = max(1, min(chunk, T))  # short batches: no padding up to a whole chunk
    pad = (-T) % chunk
    if pad:  # zero gate (no decay), zero k/v/β: padded steps leave the state unchanged
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N, C = (T + pad) // chunk, chunk
    # -> [B, H, N, C, ...]
    q, k, v, g = (x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(B, N, C, H).permute(0, 3, 1, 2)
    G = g.cumsum(3)
    diff = G.unsqueeze(4) - G.unsqueeze(3)                     # [B,H,N,C(t),C(s),K] = G_t − G_s
    idx = torch.arange(C, device=q.device)
    incl = idx[:, None] >= idx[None, :]                         # s ≤ t
    decay = torch.exp(diff.masked_fill(~incl[:, :, None], float("-inf")))
    A = torch.einsum("bhntc,bhnsc,bhntsc->bhnts", k, k, decay) * beta.unsqueeze(-1)
    A = A.masked_fill(idx[:, None] == idx[None, :], 0.0)        # strictly lower (decay is 0 above)
    P = torch.einsum("bhntc,bhnsc,bhntsc->bhnts", q, k, decay)  # inclusive lower (decay is 0 above)
    eye = torch.eye(C, device=q.device)
    L = eye + A
    solve = lambda rhs: torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)  # noqa: E731
    eG = torch.exp(G)
    U0 = solve(beta.unsqueeze(-1) * v)                           # [B,H,N,C,V]
    Wk = solve(beta.unsqueeze(-1) * (eG * k))                    # [B,H,N,C,K]
    Qg = eG * q
    Kend = torch.exp(G[:, :, :, -1:] - G) * k                    # e^{G_C − G_s} k_s
    gend = eG[:, :, :, -1]                                       # [B,H,N,K]
    # chunk n maps its start state S to e^{G_C}⊙S + Kendᵀ(U0 − Wk S) = M_n S + R_n; a log-depth scan of
    # these affine maps gives every chunk's start state with no per-chunk Python loop
    M = torch.diag_embed(gend) - Kend.transpose(-1, -2) @ Wk     # [B,H,N,K,K]
    R = Kend.transpose(-1, -2) @ U0                              # [B,H,N,K,V]
    step = 1
    while step < N:  # Hillis-Steele: map n becomes map n ∘ map n-step ∘ ...
        M, R = (torch.cat([M[:, :, :step], M[:, :, step:] @ M[:, :, :-step]], 2),
                torch.cat([R[:, :, :step], M[:, :, step:] @ R[:, :, :-step] + R[:, :, step:]], 2))
        step *= 2
    S0 = torch.zeros(B, H, 1, K, V, device=q.device) if S0 is None else S0.float().unsqueeze(2)
    S_after = M @ S0 + R                                         # state after each chunk
    S_start = torch.cat([S0, S_after[:, :, :-1]], 2)
    o = (Qg - P @ Wk) @ S_start + P @ U0                         # [B,H,N,C,V]
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o, S_after[:, :, -1]


def chunk_kda_aligned(q, k, v, g, beta, S0, chunk: int = INVARIANT_ALIGN):
    """Batch-invariant mode's prefill form: chunk_kda one whole chunk at a time from S0 (the last zero-padded to a
    whole chunk), each chunk's state passed to the next. A token's bits then depend only on its chunk and the state
    before it, so a prompt split at chunk multiples (a prefix hit, chunked prefill, snapshot cuts) gives the same
    bits as the whole prompt (chunk_kda's log-depth scan over a row's chunks sums in an order set by the row's start)."""
    T = q.shape[1]
    pad = (-T) % chunk
    if pad:  # zero gate, k, v and β: the padded steps leave the state unchanged
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    outs, S = [], S0
    for a in range(0, T + pad, chunk):
        o, S = chunk_kda(q[:, a:a + chunk], k[:, a:a + chunk], v[:, a:a + chunk], g[:, a:a + chunk],
                         beta[:, a:a + chunk], S0=S, chunk=chunk)
        outs.append(o)
    return torch.cat(outs, 1)[:, :T], S


class KDA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, d, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
        self.H, self.d = H, d
        self.rank = d  # low-rank gate width (f_a / g_a) = head_dim in the published checkpoints
        g_w = H * d if cfg.kda_full_rank_gate else self.rank
        # one GEMM for everything that reads x: q | k | v | f_a | g_a (or g) | b
        self.splits = [3 * H * d, self.rank, g_w, H]
        self.in_proj = param(sum(self.splits), D, dtype=dtype)
        self.f_b = param(H * d, self.rank, dtype=dtype)
        self.g_b = None if cfg.kda_full_rank_gate else param(H * d, self.rank, dtype=dtype)
        self.conv_w = param(3 * H * d, cfg.kda_conv_size, dtype=dtype)
        self.A_log = param(H, dtype=torch.float32)
        self.dt_bias = param(H * d, dtype=torch.float32)
        self.o_norm = param(d, dtype=dtype)
        self.o_proj = param(D, H * d, dtype=dtype)

    def hf_params(self, prefix: str) -> list[HFParam]:
        H, d, D, W = self.H, self.d, self.cfg.hidden_size, self.cfg.kda_conv_size
        gname = ("g_proj.weight", H * d) if self.cfg.kda_full_rank_gate else ("g_a_proj.weight", self.rank)
        out = split_rows(self.in_proj, prefix, [("q_proj.weight", H * d), ("k_proj.weight", H * d), ("v_proj.weight", H * d),
                                                ("f_a_proj.weight", self.rank), gname, ("b_proj.weight", H)], (D,))
        conv = self.conv_w.view(3 * H * d, 1, W)
        out += split_rows(conv, prefix, [("q_conv1d.weight", H * d), ("k_conv1d.weight", H * d), ("v_conv1d.weight", H * d)], (1, W))
        out += [(prefix + "f_b_proj.weight", self.f_b, (H * d, self.rank))]
        if self.g_b is not None:
            out += [(prefix + "g_b_proj.weight", self.g_b, (H * d, self.rank))]
        out += [(prefix + "A_log", self.A_log, (1, 1, H, 1)), (prefix + "dt_bias", self.dt_bias, (H * d,)),
                (prefix + "o_norm.weight", self.o_norm, (d,)), (prefix + "o_proj.weight", self.o_proj, (D, H * d))]
        return out

    def project(self, x: torch.Tensor):
        """x [N, D] -> qkv (raw, pre-conv) [N, 3Hd], f [N, Hd], beta logits [N, H], r [N, Hd]."""
        qkv, fa, ga, b = linear(x, self.in_proj).split(self.splits, dim=-1)
        f = linear(fa, self.f_b)
        r = ga if self.g_b is None else linear(ga, self.g_b)
        return qkv, f, b, r

    def mix(self, y: torch.Tensor, f, b, S: torch.Tensor, trace: torch.Tensor | None = None,
            prefill: bool = False) -> torch.Tensor:
        """y [B, T, 3Hd] conv outputs for B sequences of T tokens; S [B,H,K,V] updated in place -> o [B,T,H,d] FP32.
        trace [T, H, K, V] (B = 1): receives the state after each token (speculative rollback). prefill: a prompt's
        tokens (batch-invariant mode takes the aligned chunk form for any length; decode and verify rows the recurrence)."""
        H, d = self.H, self.d
        q, k, v = y.unflatten(-1, (3, H, d)).unbind(2)
        q, k = l2norm(q) * d ** -0.5, l2norm(k)
        g = kda_gate(f, self.A_log, self.dt_bias, H, self.cfg.kda_gate_lower_bound)
        beta = torch.sigmoid(b.float())
        if prefill and trace is None and kernels.batch_invariant():
            o, S_end = chunk_kda_aligned(q, k, v, g, beta, S)
            S.copy_(S_end)
            return o
        if y.shape[1] >= CHUNKED_MIN_TOKENS and trace is None:  # long prefill: the chunked form, exact up to rounding
            o, S_end = chunk_kda(q, k, v, g, beta, S0=S)
            S.copy_(S_end)
            return o
        outs = []
        for t in range(y.shape[1]):
            outs.append(delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]))
            if trace is not None:
                trace[t] = S[0]
        return torch.stack(outs, 1)

    def fla_conv(self, ops, x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """fla's short conv + SiLU over one row x [T, C] after its window conv_state [W-1, C] -> [T, C]."""
        init = x.new_zeros(1, x.shape[1], conv_state.shape[0] + 1)  # fla's window [N, C, W]: slot j holds input j - W
        init[0, :, 1:] = conv_state.T
        return ops.causal_conv1d(x.contiguous().unsqueeze(0), weight=self.conv_w, activation="silu",
                                 initial_state=init)[0][0]

    def conv_qkv(self, ops, x: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor | None = None):
        """One row's short conv + SiLU: x [T, 3Hd] raw projections (any row stride) after its window
        conv_state [W-1, 3Hd] -> (qkv planes [3, T, H, d], each contiguous, into `out` if given; whether q and
        k are already L2-normalised). The fused kernel where it runs, else fla's conv and copies."""
        from .. import kernels
        if CONV_KERNEL and kernels.available(x.device):
            from ..kernels.kda_conv import kda_conv
            return kda_conv(x, conv_state, self.conv_w, self.H, QK_NORM_EPS, out=out), True
        y = self.fla_conv(ops, x, conv_state).view(x.shape[0], 3, self.H, self.d).permute(1, 0, 2, 3)
        return (y.contiguous() if out is None else out.copy_(y)), False

    def fla_gates(self, normed: bool = False) -> dict:
        """chunk_kda's arguments for this layer: gate, β (and the q/k L2 norms unless `normed`) inside its
        kernels (the same math as kda_gate / l2norm here), the final state returned."""
        lb = self.cfg.kda_gate_lower_bound
        return dict(scale=self.d ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=not normed, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                    **(dict(safe_gate=True, lower_bound=lb) if lb is not None else {}))

    def fla_out(self, ops, o: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        """An fla row's W_o input: o [T, H, d], r [T, Hd] -> out [T, Hd] := RMSNorm(o)·w ⊙ σ(r) (as gate_norm).
        The gated-norm kernel reads o and r's strided rows and writes out's rows in place: no cat of a row's
        pieces at its snapshot cut (H200: ~2.5 ms of a cold 32K prompt); fla's norm and a copy where the
        kernels do not run."""
        if kernels.available(o.device):
            from ..kernels.norm import gated_rms_norm
            gated_rms_norm(o, r, self.o_norm, self.cfg.rms_norm_eps, out=out)
            return
        out.copy_(ops.rms_norm_gated(o.reshape(-1, self.d), r.reshape(-1, self.d).contiguous(), self.o_norm, None,
                                     activation="sigmoid", eps=self.cfg.rms_norm_eps).view(r.shape[0], -1))

    def prefill_fla(self, ops, qkv: torch.Tensor, f, b, r, S, conv_state, cuts, cache, kl, out) -> torch.Tensor:
        """One prefill row through fla on the GPU: qkv [T, 3Hd], f [T, Hd], b [T, H], r [T, Hd] raw projections
        (model dtype), S [1, H, K, V] FP32 updated in place, conv_state [W-1, C]; out [T, Hd] receives W_o's
        input, piece by piece -> the new conv window. The conv and q/k L2 norms run in conv_qkv, the gate and β
        inside fla's kernels (the same math as causal_conv / l2norm / kda_gate here); cuts: (offset, snapshot)
        states taken on the way."""
        T, H, d, W1 = qkv.shape[0], self.H, self.d, self.cfg.kda_conv_size - 1
        y, normed = self.conv_qkv(ops, qkv, conv_state)
        q, k, v = (t.unsqueeze(0) for t in y.unbind(0))
        fg, bb = f.view(1, T, H, d).contiguous(), b.reshape(1, T, H).contiguous()
        window = lambda hi: torch.cat([conv_state, qkv[max(0, hi - W1):hi]])[-W1:]  # noqa: E731  inputs before hi
        lo = 0
        for hi, snap in cuts:
            o, S_end = ops.chunk_kda(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], fg[:, lo:hi], bb[:, lo:hi],
                                     initial_state=S, **self.fla_gates(normed))
            S.copy_(S_end)
            self.fla_out(ops, o[0], r[lo:hi], out[lo:hi])
            if snap is not None:
                cache.snap_state[kl, snap] = S[0]
                cache.snap_conv[kl, snap] = window(hi)
            lo = hi
        return window(T)

    def prefill_fla_rows(self, ops, rows, qkv, f, b, r, state, conv, cache, kl, out) -> None:
        """Several rows' heads through one varlen chunk_kda call (the conv and the gated norm per row):
        rows = [(a, m, slot, snapshot or None)], each head qkv[a:m] ending at its one cut. The same math as
        prefill_fla row by row; each head's final state is its snapshot and the state its tail reads."""
        H, d, W1 = self.H, self.d, self.cfg.kda_conv_size - 1
        T = sum(m - a for a, m, _, _ in rows)
        y = qkv.new_empty(3, T, H, d)  # every row's conv output lands in its rows of the q, k, v planes
        fs, bs, wins, at = [], [], [], 0
        for a, m, s, _ in rows:
            c = conv[s][0]
            normed = self.conv_qkv(ops, qkv[a:m], c, out=y[:, at:at + m - a])[1]
            fs.append(f[a:m]), bs.append(b[a:m])
            wins.append(torch.cat([c, qkv[max(a, m - W1):m]])[-W1:])  # the W-1 inputs before the head's end
            at += m - a
        q, k, v = (t.unsqueeze(0) for t in y.unbind(0))
        fg, bb = torch.cat(fs).view(1, T, H, d), torch.cat(bs).view(1, T, H)
        lens = torch.tensor([0] + [m - a for a, m, _, _ in rows]).cumsum(0)
        # through pinned memory: no host wait (fla builds its chunk indices on the device)
        cu = lens.pin_memory().to(qkv.device, non_blocking=True) if qkv.is_cuda else lens
        slots = torch.cat([s for _, _, s, _ in rows])
        o, S_end = ops.chunk_kda(q, k, v, fg, bb, initial_state=state[slots], cu_seqlens=cu, use_graph=True,
                                 **self.fla_gates(normed))
        state[slots] = S_end
        at = 0
        for j, (a, m, s, snap) in enumerate(rows):
            conv[s] = wins[j].unsqueeze(0)
            if snap is not None:
                cache.snap_state[kl, snap] = S_end[j]
                cache.snap_conv[kl, snap] = wins[j]
            self.fla_out(ops, o[0, at:at + m - a], r[a:m], out[a:m])  # each row's W_o input in its own rows
            at += m - a

    def gate_norm(self, o: torch.Tensor, r: torch.Tensor, dtype) -> torch.Tensor:
        """o [..., H, d] FP32, r [..., Hd] -> RMSNorm(o)·w ⊙ σ(r) [..., Hd] in dtype (W_o's input)."""
        o = rms_norm(o, self.o_norm, self.cfg.rms_norm_eps).float() * torch.sigmoid(r.float()).unflatten(-1, (self.H, self.d))
        return o.flatten(-2).to(dtype)

    def output(self, o: torch.Tensor, r: torch.Tensor, dtype) -> torch.Tensor:
        """o [..., H, d] FP32, r [..., Hd] -> W_o (RMSNorm(o)·w ⊙ σ(r))."""
        return linear(self.gate_norm(o, r, dtype), self.o_proj)

    def prefill_short(self, qkv, f, b, r, state, conv, slot, cuts, cache, kl, out) -> None:
        """One short prefill row through the one-kernel recurrence (kernels/kda.py, the decode kernel, which
        takes any T): conv, gates, L2 norms, the delta rule and the gated norm in one launch per segment
        between snapshot cuts. Rows [T, ·] in the model dtype; `out` [T, Hd] receives W_o's input."""
        from ..kernels.kda import kda_decode
        lb = self.cfg.kda_gate_lower_bound
        lo = 0
        for hi, snap in cuts:
            kda_decode(qkv[None, lo:hi], f[None, lo:hi], b[None, lo:hi], r[None, lo:hi], self.conv_w, self.A_log,
                       self.dt_bias, self.o_norm, state, conv, slot, gate="softplus" if lb is None else "bounded",
                       lower_bound=lb if lb is not None else -5.0, eps_qk=QK_NORM_EPS, eps_o=self.cfg.rms_norm_eps,
                       out=out[None, lo:hi])
            if snap is not None:  # the kernel left the state and the conv window (W-1 inputs before hi) in place
                cache.snap_state[kl, snap] = state[slot][0]  # slot: a [1] device tensor (no host sync)
                cache.snap_conv[kl, snap] = conv[slot][0]
            lo = hi

    def forward(self, x: torch.Tensor, step, cache) -> torch.Tensor:
        return self.post(self.core(self.project(x), step, cache))

    pre = project  # the token-parallel work before the recurrence (prefill graphs capture it)

    def post(self, out: torch.Tensor, pre=None) -> torch.Tensor:
        """W_o over the core's rows (token-parallel: prefill graphs capture it)."""
        return linear(out, self.o_proj)

    def core(self, pre, step, cache) -> torch.Tensor:
        """The recurrence over the step's rows: pre = project(x) (rows past the step's tokens, a prefill
        graph's padding, are ignored) -> W_o's input [N, Hd] in the model dtype, row by row."""
        kl = cache.kda_index[self.layer]
        state, conv = cache.state[kl], cache.conv[kl]
        N = step.input_ids.shape[0]
        qkv, f, b, r = (t[:N] for t in pre)
        dt = qkv.dtype  # the model dtype
        W1 = self.cfg.kda_conv_size - 1
        Hd = self.H * self.d
        out = torch.empty(N, Hd, dtype=dt, device=qkv.device)
        dec = [i for i, q in enumerate(step.q_lens) if q == 1]
        offs = torch.tensor([0] + step.q_lens, device="cpu").cumsum(0).tolist()
        if dec:  # decode sequences together: one token each, the PyTorch form (the oracle of the decode kernels)
            tok, rows = step.decode_rows()[1:] if len(dec) < len(step.q_lens) else (None, None)
            sel = (lambda t: t) if tok is None else (lambda t: t[tok])  # noqa: E731
            slots = step.kda_slots if tok is None else step.kda_slots[rows]
            x_ext = torch.cat([conv[slots], sel(qkv).unsqueeze(1).to(conv.dtype)], 1)
            conv[slots] = x_ext[:, 1:]
            S = state[slots]
            y = causal_conv(x_ext, self.conv_w)
            if kernels.batch_invariant():  # one row at a time: torch's reductions pick their split by the tensor's size
                o = torch.cat([self.mix(y[j:j + 1], sel(f)[j:j + 1, None], sel(b)[j:j + 1, None], S[j:j + 1])
                               for j in range(y.shape[0])])
            else:
                o = self.mix(y, sel(f).unsqueeze(1), sel(b).unsqueeze(1), S)
            state[slots] = S
            o = self.gate_norm(o[:, 0], sel(r), dt)
            if tok is None:
                out = o
            else:
                out[tok] = o
        snaps = getattr(step, "kda_snapshots", None) or {}
        # FP32 runs are the oracle: fla's dots take FP32 inputs at TF32 (~1e-3), so they use the torch forms;
        # verify rows (kda_ckpt) need the state after every position, which only the torch form records
        plain = getattr(step, "kda_ckpt", None) is None
        fast_ok = qkv.is_cuda and dt != torch.float32 and plain and len(dec) < len(step.q_lens)  # prefill rows
        ops = fla_ops() if fast_ok else None
        # batch-invariant mode: every prefill row in one form (fla's chunks, or chunk_kda_aligned), each row in its own
        # call, so its bits depend on its chunk-aligned cuts alone, not on its length or the rows beside it
        invariant = kernels.batch_invariant()
        short = (plain and len(dec) < len(step.q_lens) and (fast_ok if SHORT_ROWS_KERNEL is None else SHORT_ROWS_KERNEL)
                 and kernels.available(qkv.device) and not invariant)
        rows = []
        for i, q in enumerate(step.q_lens):
            if q == 1:
                continue
            cuts = sorted(snaps.get(i, [])) + [(q, None)]  # prefix caching: states taken on the way
            # the row's tail from its first cut with <= SHORT_ROW_MAX_TOKENS after it takes the one-kernel
            # recurrence (a whole short row; a long one's tail after its last snapshot: one launch, not fla's
            # ~1 ms of host work per call); the head before it the chunked form
            h = next((lo for lo in [0] + [c for c, _ in cuts[:-1]] if q - lo <= SHORT_ROW_MAX_TOKENS), q) if short else q
            if 0 < h < q and ops is not None and q >= FLA_TAIL_MIN_TOKENS:
                h = q
            rows.append((i, q, cuts, h, [(c, sn) for c, sn in cuts if c <= h]))  # head: cuts up to h
        # long rows of one step whose fla part ends at one cut share one varlen chunk_kda call (fla's ~1 ms of
        # host work per call: once per layer, not per row)
        varlen = ops is not None and (self.cfg.kda_gate_lower_bound is None or VARLEN_BOUNDED_GATE) and not invariant
        together = [row for row in rows if row[3] and len(row[4]) == 1] if varlen else []
        if len(together) > 1:  # heads ending at their one cut: one varlen fla call for all of them
            self.prefill_fla_rows(ops, [(offs[i], offs[i] + h, step.kda_slots[i:i + 1], head[0][1])
                                        for i, _, _, h, head in together], qkv, f, b, r, state, conv, cache, kl, out)
        done = {row[0] for row in together} if len(together) > 1 else set()  # rows whose head ran there
        for i, q, cuts, h, head in rows:
            a, e = offs[i], offs[i + 1]
            s = step.kda_slots[i:i + 1]
            if h == 0:  # a short row, all of it
                self.prefill_short(qkv[a:e], f[a:e], b[a:e], r[a:e], state, conv, s, cuts, cache, kl, out[a:e])
                continue
            m = a + h  # the head: rows a..m
            if i in done:
                pass
            elif ops is not None:  # long rows: fla's few kernels (chunked) beat a per-token loop at any length
                S = state[s]
                conv[s] = self.prefill_fla(ops, qkv[a:m], f[a:m], b[a:m], r[a:m], S, conv[s][0], head, cache, kl,
                                           out[a:m])
                state[s] = S
            else:
                x_ext = torch.cat([conv[s], qkv[a:m].unsqueeze(0).to(conv.dtype)], 1)
                conv[s] = x_ext[:, -W1:]
                S = state[s]
                ck = step.kda_ckpt if h <= (step.kda_ckpt[0].shape[2] if getattr(step, "kda_ckpt", None) else 0) else None
                if ck is not None:  # verify rows: conv window after each position, for rollback
                    ck[1][kl, i, :h] = x_ext[0].unfold(0, W1, 1)[1:].transpose(1, 2)
                y = causal_conv(x_ext, self.conv_w)
                o, lo = [], 0
                for hi, snap in head:
                    o.append(self.mix(y[:, lo:hi], f[a + lo:a + hi].unsqueeze(0), b[a + lo:a + hi].unsqueeze(0), S,
                                      trace=None if ck is None else ck[0][kl, i, :h], prefill=True))
                    if snap is not None:
                        cache.snap_state[kl, snap] = S[0]
                        cache.snap_conv[kl, snap] = x_ext[0, hi:hi + W1]  # the W-1 inputs before that position
                    lo = hi
                state[s] = S
                out[a:m] = self.gate_norm(torch.cat(o, 1)[0], r[a:m], dt)
            if h < q:  # the tail, from the state and conv window the head left in the cache
                self.prefill_short(qkv[m:e], f[m:e], b[m:e], r[m:e], state, conv, s,
                                   [(c - h, sn) for c, sn in cuts if c > h], cache, kl, out[m:e])
        return out
