"""MLA (multi-head latent attention), NoPE: one 576-wide latent entry per token.

K3 adds a q-LoRA (q = W_qb RMSNorm(W_qa x)) and a sigmoid output gate
(o ← o ⊙ σ(W_g x) before o_proj); W_qa and W_g read x, so they join the fused in_proj.

Prefill expands the latents through kv_b (in the model's dtype) and attends causally: on the GPU
through the flash-attention Triton kernel (kernels/mla_prefill.py; no T x L scores) or, for a cold
row, cuDNN's fused attention (kernels/mla_prefill_sdpa.py), elsewhere in
plain PyTorch a block of queries at a time. Decode uses the absorbed form over the cached latents
(docs/models.md). Both read the entries back from the cache, so an FP8 cache affects both paths alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.group import SINGLE
from ..parallel.slicing import slicing
from .. import kernels
from .layers import HFParam, invariant_kernels, linear, param, rms_norm, split_rows

PREFILL_KERNEL: bool | None = None  # None: the Triton flash kernel wherever it is available on a GPU; tests force it
TORCH_QUERY_BLOCK = 256  # queries per block in the PyTorch prefill: scores [H, 256, L] FP32 stay small
KEY_BLOCK = 64  # batch-invariant mode's PyTorch prefill: keys in fixed blocks from position 0 (an online softmax), so
#   a query's sums do not depend on how many keys the step holds (a prefix hit, a chunk) or how many queries


def use_prefill_kernel(q: torch.Tensor) -> bool:
    from .. import kernels
    if PREFILL_KERNEL is not None:
        return PREFILL_KERNEL and kernels.available(q.device)
    return q.is_cuda and kernels.available(q.device)


class MLA(nn.Module):
    """With tensor parallel the q (or q_b) and g rows are the rank's heads; kv_a and q_a are
    replicated, or with slicing (parallel/slicing.py) a row slice per rank whose outputs one
    all-gather completes (gather_sliced)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype, tp=SINGLE):
        super().__init__()
        self.cfg, self.layer, self.tp = cfg, layer, tp
        H, D = cfg.mla_num_heads, cfg.hidden_size
        self.H, self.nope, self.rope, self.vd, self.r = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_dim = H * cfg.qk_head_dim
        ql = cfg.q_lora_rank
        self.gate_dim = H * self.vd if cfg.mla_output_gate else 0
        sl = slicing(cfg, tp)
        # which of (q part, kv_a) this rank holds as a 1/N row slice: q only when it is q-LoRA's q_a
        self.sliced = (bool(ql) and sl.get("q_a", "") is None, sl.get("kv_a", "") is None)
        self.full = [ql or self.q_dim, cfg.latent_dim]  # widths after gather_sliced
        # in_proj rows: q_proj (or q_a_proj) | kv_a_proj_with_mqa | g_proj (K3)
        self.splits = [n // tp.world if s else n for n, s in zip(self.full, self.sliced)] + [self.gate_dim]
        self.in_proj = param(sum(self.splits), D, dtype=dtype)
        self.q_a_norm = param(ql, dtype=dtype) if ql else None
        self.q_b = param(self.q_dim, ql, dtype=dtype) if ql else None
        self.kv_norm = param(self.r, dtype=dtype)
        self.kv_b = param(H * (self.nope + self.vd), self.r, dtype=dtype)
        self.o_proj = param(D, H * self.vd, dtype=dtype)
        self.sm_scale = cfg.qk_head_dim ** -0.5

    def hf_params(self, prefix: str) -> list[HFParam]:
        D, ql = self.cfg.hidden_size, self.cfg.q_lora_rank
        q_rows, kv_rows = self.splits[:2]
        parts = [("q_a_proj.weight" if ql else "q_proj.weight", q_rows), ("kv_a_proj_with_mqa.weight", kv_rows)]
        parts += [("g_proj.weight", self.gate_dim)] if self.gate_dim else []
        out = split_rows(self.in_proj, prefix, parts, (D,))
        if ql:
            out += [(prefix + "q_a_layernorm.weight", self.q_a_norm, (ql,)), (prefix + "q_b_proj.weight", self.q_b, (self.q_dim, ql))]
        return out + [
            (prefix + "kv_a_layernorm.weight", self.kv_norm, (self.r,)),
            (prefix + "kv_b_proj.weight", self.kv_b, tuple(self.kv_b.shape)),
            (prefix + "o_proj.weight", self.o_proj, tuple(self.o_proj.shape))]

    @property
    def w_uk_uv(self):
        """Absorbed views of kv_b (no copy): W_UK [H, nope, r], W_UV [H, v, r]."""
        w = self.kv_b.view(self.H, self.nope + self.vd, self.r)
        return w[:, : self.nope], w[:, self.nope:]

    def gather_sliced(self, q: torch.Tensor, kva: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q part, kv_a) outputs of this rank's in_proj rows -> the full ones: the sliced parts of
        every rank, in rank order, from one all-gather (a no-op without slicing)."""
        if not any(self.sliced):
            return q, kva
        parts = [t for t, s in zip((q, kva), self.sliced) if s]
        every = self.tp.all_gather_stacked(torch.cat(parts, -1))  # [ranks, N, Σ widths]: one collective
        whole = iter(p.permute(1, 0, 2).reshape(q.shape[0], -1)  # rank-major columns: the full rows' order
                     for p in every.split([t.shape[-1] for t in parts], -1))
        return tuple(next(whole) if s else t for t, s in zip((q, kva), self.sliced))

    def project(self, x):
        """x [N, D] -> q [N, H, nope+rope], cache entries [N, r+rope] (normalised latent | k_r), gate logits [N, H·v] or None."""
        q, kva, g = linear(x, self.in_proj).split(self.splits, dim=-1)
        q, kva = self.gather_sliced(q, kva)
        if self.q_b is not None:
            q = linear(rms_norm(q, self.q_a_norm, self.cfg.mla_norm_eps), self.q_b)
        c = rms_norm(kva[:, : self.r], self.kv_norm, self.cfg.mla_norm_eps)
        return q.view(-1, self.H, self.cfg.qk_head_dim), torch.cat([c, kva[:, self.r:]], -1), (g if self.gate_dim else None)

    def decode_attn(self, q: torch.Tensor, cache, block_tables, context_lens_t, max_len: int) -> torch.Tensor:
        """Absorbed decode for S sequences, one query each: q [S, H, nope+rope] -> [S, H, v] FP32."""
        w_uk, w_uv = self.w_uk_uv
        q_lat = torch.einsum("shn,hnr->shr", q[..., : self.nope].float(), w_uk.float())
        qh = torch.cat([q_lat, q[..., self.nope:].float()], -1)
        lat = cache.gather_latent_batch(self.layer, block_tables, max_len)  # [S, L, r+rope]
        s = torch.einsum("shc,slc->shl", qh, lat) * self.sm_scale
        pos = torch.arange(max_len, device=q.device)
        s = s.masked_fill(pos[None, None, :] >= context_lens_t[:, None, None], float("-inf"))
        o_lat = torch.einsum("shl,slr->shr", torch.softmax(s, -1), lat[..., : self.r])
        return torch.einsum("shr,hvr->shv", o_lat, w_uv.float())

    def prefill_attn(self, q: torch.Tensor, lat: torch.Tensor, start: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: q [T, H, nope+rope] at positions start.., lat [L, r+rope] -> [T, H, v] FP32 (the flash
        kernel writes the model dtype straight into `out` when it is given in that dtype)."""
        dt = self.kv_b.dtype
        kv = linear(lat[:, : self.r].to(dt), self.kv_b).view(-1, self.H, self.nope + self.vd)
        invariant = kernels.batch_invariant()
        if use_prefill_kernel(q) or (invariant and invariant_kernels(q)):
            from ..kernels import mla_prefill_sdpa as cold
            from ..kernels.mla_prefill import invariant_config, mla_prefill
            args = (q.to(dt), kv[..., : self.nope], lat[:, self.r:].to(dt), kv[..., self.nope:], self.sm_scale)
            dst = out if out is not None and out.dtype == dt else None
            if invariant:  # cold and warm rows alike through the flash kernel, its config fixed, no KV splits
                o = mla_prefill(*args, start, out=dst, config=invariant_config(self.nope, self.rope, self.vd, dt))
                return o if o is out else o.float()
            if cold.usable(q, q.shape[0], lat.shape[0], start):  # a cold row: cuDNN's fused attention
                o = dst if dst is not None else torch.empty(q.shape[0], self.H, self.vd, dtype=dt, device=q.device)
                if cold.try_attend(*args, out=o):
                    return o if o is out else o.float()
            o = mla_prefill(*args, start, out=dst)
            return o if o is out else o.float()
        kv = kv.float()
        k = torch.cat([kv[..., : self.nope], lat[:, None, self.r:].float().expand(-1, self.H, -1)], -1)
        T, L = q.shape[0], lat.shape[0]
        if invariant:
            return self.prefill_attn_blocks(q.float(), k, kv[..., self.nope:], start)
        out = torch.empty(T, self.H, self.vd, dtype=torch.float32, device=q.device)
        for a in range(0, T, TORCH_QUERY_BLOCK):
            b = min(T, a + TORCH_QUERY_BLOCK)
            s = torch.einsum("thc,lhc->htl", q[a:b].float(), k) * self.sm_scale
            causal = torch.arange(L, device=q.device)[None, :] > (start + torch.arange(a, b, device=q.device))[:, None]
            p = torch.softmax(s.masked_fill(causal, float("-inf")), -1)
            out[a:b] = torch.einsum("htl,lhv->thv", p, kv[..., self.nope:])
        return out

    def prefill_attn_blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Batch-invariant mode's PyTorch prefill: q [T, H, c], k [L, H, c], v [L, H, v] FP32 -> [T, H, v], the keys
        KEY_BLOCK at a time from position 0 (the last block zero-padded) with an online softmax: every product has
        one shape, and a block past a query's position adds exactly nothing to it."""
        T, L = q.shape[0], k.shape[0]
        pad = (-L) % KEY_BLOCK
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
        qpos = start + torch.arange(T, device=q.device)
        m = torch.full((self.H, T), float("-inf"), device=q.device)
        l = torch.zeros(self.H, T, device=q.device)
        acc = torch.zeros(self.H, T, v.shape[-1], device=q.device)
        for j in range(0, L, KEY_BLOCK):
            s = torch.einsum("thc,lhc->htl", q, k[j:j + KEY_BLOCK]) * self.sm_scale
            s = s.masked_fill(torch.arange(j, j + KEY_BLOCK, device=q.device)[None, :] > qpos[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))  # key 0 is in the first block: finite from there on
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new.unsqueeze(-1))
            l = l * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + torch.einsum("htl,lhv->htv", p, v[j:j + KEY_BLOCK])
            m = m_new
        return (acc / l.unsqueeze(-1)).transpose(0, 1)

    def decode_rows_invariant(self, q: torch.Tensor, cache, block_tables, ctx: list[int]) -> torch.Tensor:
        """Batch-invariant mode's decode attention: row by row over exactly its own keys (the batched form reduces over
        the batch's longest context, so a row's sums change with the rows beside it) -> [S, H, v] FP32."""
        return torch.cat([self.decode_attn(q[i:i + 1], cache, block_tables[i:i + 1], torch.tensor([n], device=q.device), n)
                          for i, n in enumerate(ctx)]) if ctx else q.new_empty(0, self.H, self.vd, dtype=torch.float32)

    def warm_cold_attention(self, max_T: int, log=None) -> int:
        """Build the cuDNN plans cold rows of up to max_T tokens use (kernels/mla_prefill_sdpa.py; every MLA
        layer has this layer's shapes) -> plans built."""
        from ..kernels import mla_prefill_sdpa as cold
        if not use_prefill_kernel(self.kv_b):
            return 0
        return cold.warm(self.H, self.nope, self.rope, self.vd, self.sm_scale, self.kv_b.dtype, self.kv_b.device, max_T, log)

    def forward(self, x: torch.Tensor, step, cache) -> torch.Tensor:
        pre = self.project(x)
        return self.post(self.core(pre, step, cache), pre)

    pre = project  # the token-parallel work before attention (prefill graphs capture it)

    def post(self, o: torch.Tensor, pre) -> torch.Tensor:
        """o [N, H·v] FP32 -> the output gate (K3) and W_o (token-parallel: prefill graphs capture it)."""
        gate = pre[2]
        if gate is not None:
            o = o * torch.sigmoid(gate.float())
        return linear(o.to(self.o_proj.dtype), self.o_proj)

    def core(self, pre, step, cache) -> torch.Tensor:
        """Cache writes and attention over the step's rows: pre = project(x) (rows past the step's tokens,
        a prefill graph's padding, are ignored) -> o [N, H·v] FP32."""
        N = step.input_ids.shape[0]
        q, entries = pre[0][:N], pre[1][:N]
        cache.write_latent(self.layer, step.slot_mapping, entries)
        if kernels.batch_invariant() and (step.is_decode or step.spec_tokens):
            # decode rows one at a time; a verify row's T queries as T decode rows (speculation gives plain decoding's bits)
            T = step.spec_tokens or 1
            rows = [(i, c - T + 1 + t) for i, c in enumerate(step.context_lens) for t in range(T)]
            tables = step.block_tables[torch.tensor([i for i, _ in rows], device=step.block_tables.device)]
            o = self.decode_rows_invariant(q, cache, tables, [n for _, n in rows])
        elif step.is_decode:
            o = self.decode_attn(q, cache, step.block_tables, step.context_lens_t, step.max_context)
        else:
            dec = [i for i, n in enumerate(step.q_lens) if n == 1]
            # prefill rows only, through the flash kernel: its model-dtype output lands in o as it is (the same
            # rounding as its FP32 copy, without the copies; ~5 ms of a cold 32K prompt); decode rows' FP32 otherwise
            kern = not dec and use_prefill_kernel(q) and q.dtype != torch.float32
            o = torch.empty(N, self.H, self.vd, dtype=self.kv_b.dtype if kern else torch.float32, device=q.device)
            a = 0
            if dec and kernels.batch_invariant():
                _, tok, idx = step.decode_rows()
                o[tok] = self.decode_rows_invariant(q[tok], cache, step.block_tables[idx],
                                                    [step.context_lens[i] for i in dec]).to(o.dtype)
            elif dec:  # decode sequences of a mixed step still take the absorbed path
                _, tok, idx = step.decode_rows()
                o[tok] = self.decode_attn(q[tok], cache, step.block_tables[idx], step.context_lens_t[idx],
                                          max(step.context_lens[i] for i in dec))
            for i, n in enumerate(step.q_lens):
                if n > 1:
                    ctx = step.context_lens[i]
                    lat = cache.gather_latent(self.layer, step.block_tables[i], ctx)
                    dst = o[a:a + n]
                    r = self.prefill_attn(q[a:a + n], lat, ctx - n, out=dst)
                    if r is not dst:
                        dst.copy_(r)
                a += n
        return o.flatten(1)
