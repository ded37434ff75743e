"""DFlash / DSpark drafters: a few non-causal decoder layers that draft a block of tokens at once from the
target's hidden states (z-lab's DFlash; DeepSeek's DeepSpec adds DSpark's Markov head and confidence head).

    taps   = cat(h_L for L in target_layer_ids)        h_L: the target's residual stream after layer L
                                                        (-1: after the embedding), [C, n·H] for C context tokens
    c      = RMSNorm(fc · taps)                          [C, H], written into a paged buffer beside the target's
                                                        KV cache by the target's own forward (TapWriter)
    block  = embed([anchor, mask, ..., mask])           [Bk, H] at positions start .. start + Bk - 1 (anchor: the
                                                        last token, not yet fed to the target, at position start)
    layer  : x += o(attn(q = q_norm(q(n)), k = k_norm([k(c); k(n)]), v = [v(c); v(n)])), n = RMSNorm(x), RoPE on
             q and k at their positions, no mask (every block slot sees the whole context and the whole block);
             x += down(silu(gate(m)) · up(m)), m = RMSNorm(x)
    logits = lm_head(RMSNorm(x)) (the target's embedding and lm_head unless the folder carries its own)
z-lab's convention: slot j predicts the token at start + j, so slots 1 .. Bk-1 are the Bk - 1 drafts. DeepSpec's
(DSpark, its dflash_*_block7): slot j predicts the token at start + j + 1, all Bk slots are drafts.
DSpark: logits_j += W2 · W1[x_{j-1}] (x_{-1} the anchor, then each slot's own draft, so the slots are drawn in
order) and a confidence c_j = sigmoid(proj([h_j; W1[x_{j-1}]])), whose running product is the drafts' survival
for the verify width chooser. Greedy drafts (argmax).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import ConfigError

MARKOV_TYPES = ("vanilla",)  # DeepSpec also has "gated" and "rnn" heads: not implemented, refused at load


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list
    num_target_layers: int | None
    shifted: bool                  # DeepSpec: slot j predicts start + j + 1 (every slot a draft)
    attention_bias: bool = False
    vocab_size: int | None = None
    markov_rank: int = 0
    confidence: bool = False
    confidence_with_markov: bool = True
    input_embedding_scale: float = 1.0     # z-lab: the block's embeddings times this
    output_multiplier: float = 1.0         # z-lab: logits times this, then
    final_logit_softcapping: float | None = None  # tanh(logits / cap) · cap

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.shifted else self.block_size - 1

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "DFlashConfig":
        """A published config.json: z-lab's (architectures DFlashDraftModel; dflash_config holds mask_token_id
        and target_layer_ids, block_size top level or there) or DeepSpec's flat one (Qwen3DSparkModel)."""
        arch = (d.get("architectures") or [""])[0]
        sub = d.get("dflash_config") or {}
        deepspec = arch.startswith("Qwen3DSpark") or (arch == "" and "markov_rank" in d)
        if not deepspec and arch != "DFlashDraftModel":
            raise ConfigError(f"{where}: not a DFlash or DSpark drafter (architectures {d.get('architectures')})")

        def get(key, default=None, required=True):
            v = sub.get(key, d.get(key, default))
            if v is None and required:
                raise ConfigError(f"{where}: missing '{key}'")
            return v
        for t in d.get("layer_types") or []:
            if t != "full_attention":
                raise ConfigError(f"{where}: layer type '{t}' is not supported (full_attention only)")
        markov_type = d.get("markov_head_type", "vanilla")
        if int(d.get("markov_rank", 0) or 0) and markov_type not in MARKOV_TYPES:
            raise ConfigError(f"{where}: markov_head_type '{markov_type}' is not supported ({', '.join(MARKOV_TYPES)})")
        heads = int(get("num_attention_heads"))
        rope = d.get("rope_parameters") or {}
        return cls(hidden_size=int(get("hidden_size")), intermediate_size=int(get("intermediate_size")),
                   num_layers=int(get("num_hidden_layers")), num_heads=heads,
                   num_kv_heads=int(get("num_key_value_heads", heads)),
                   head_dim=int(get("head_dim", None, False) or int(get("hidden_size")) // heads),
                   rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                   rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                   block_size=int(get("block_size")), mask_token_id=int(get("mask_token_id")),
                   target_layer_ids=[int(x) for x in get("target_layer_ids")],
                   num_target_layers=get("num_target_layers", None, False), shifted=deepspec,
                   attention_bias=bool(d.get("attention_bias", False)), vocab_size=d.get("vocab_size"),
                   markov_rank=int(d.get("markov_rank", 0) or 0),
                   confidence=bool(d.get("enable_confidence_head", False)),
                   confidence_with_markov=bool(d.get("confidence_head_with_markov", True)),
                   input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                   output_multiplier=float(get("output_multiplier", 1.0)),
                   final_logit_softcapping=get("final_logit_softcapping", None, False))


def _rope_cs(pos: torch.Tensor, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE's (cos, sin) [N, 1, hd] at positions pos [N], FP32: computed once a block, every layer's
    queries and keys share them."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=pos.device, dtype=torch.float32) / hd)
    f = pos.float()[:, None] * inv[None, :]
    f = torch.cat([f, f], -1)[:, None, :]
    return f.cos(), f.sin()


def _rotate(x: torch.Tensor, cs) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, -1)
    return x.float() * cs[0] + torch.cat([-x2, x1], -1) * cs[1]


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in FP32 out; a BF16 / FP16 weight multiplies in its own dtype (FP32 accumulation) rather than being
    widened to an FP32 copy every call (the 48B's lm_head alone is 0.75 GB in BF16)."""
    return x.float() @ w.T if w.dtype == torch.float32 else (x.to(w.dtype) @ w.T).float()


def _norm(x, w, eps):
    """RMSNorm in FP32: one fused op where torch has it (a drafter step launches ~20 norms)."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps)


class PagedContext(NamedTuple):
    """A batch's contexts left in the paged buffer (TapWriter.kv), for kernels/drafter_attn.py to read in place."""
    kv: torch.Tensor       # [layers, 2, slots, kv heads, hd]
    tables: torch.Tensor   # [B, blocks] long
    lens: torch.Tensor     # [B] long: fed positions
    block_size: int


class DFlashModel:
    """The drafter's weights (a dict of tensors, the checkpoint's names) and its two halves: context() turns the
    target's taps into c, context_kv() c into each layer's keys and values, block() drafts from them."""

    def __init__(self, cfg: DFlashConfig, weights: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        self.cfg, self.w = cfg, weights
        self.embed, self.lm_head = weights.get("embed_tokens.weight", embed), weights.get("lm_head.weight", lm_head)

    def names(self) -> dict[str, tuple]:
        """Every tensor the checkpoint must hold, with its shape."""
        c = self.cfg
        H, hd, I = c.hidden_size, c.head_dim, c.intermediate_size
        out = {"fc.weight": (H, len(c.target_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(c.num_layers):
            p = f"layers.{i}."
            out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (c.num_heads * hd, H),
                    p + "self_attn.k_proj.weight": (c.num_kv_heads * hd, H),
                    p + "self_attn.v_proj.weight": (c.num_kv_heads * hd, H),
                    p + "self_attn.o_proj.weight": (H, c.num_heads * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)}
            if c.attention_bias:
                out |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in
                        (("q", c.num_heads * hd), ("k", c.num_kv_heads * hd), ("v", c.num_kv_heads * hd))}
        V = self.lm_head.shape[0]
        if c.markov_rank:
            out |= {f"markov_head.markov_w{i}.weight": (V, c.markov_rank) for i in (1, 2)}
        if c.confidence:
            out |= {"confidence_head.proj.weight": (1, H + (c.markov_rank if c.confidence_with_markov else 0)),
                    "confidence_head.proj.bias": (1,)}
        return out

    def _lin(self, x, name):
        y = _mm(x, self.w[name + ".weight"])
        b = self.w.get(name + ".bias")
        return y if b is None else y + b.float()

    def _qkv(self, x: torch.Tensor, i: int, cs):
        """Layer i's attention inputs for block states x [N, H]: q [N, heads, hd], k and v [N, kv heads, hd]
        (q and k normed and rotated by cs = _rope_cs of their positions)."""
        cfg, p = self.cfg, f"layers.{i}."
        n = _norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = self._lin(n, p + "self_attn.q_proj").view(-1, cfg.num_heads, cfg.head_dim)
        q = _rotate(_norm(q, self.w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps), cs)
        k = self._lin(n, p + "self_attn.k_proj").view(-1, cfg.num_kv_heads, cfg.head_dim)
        k = _rotate(_norm(k, self.w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps), cs)
        return q, k, self._lin(n, p + "self_attn.v_proj").view(-1, cfg.num_kv_heads, cfg.head_dim)

    def _finish(self, x: torch.Tensor, o: torch.Tensor, i: int) -> torch.Tensor:
        """Layer i after attention: x + o_proj(o), then its MLP's residual."""
        cfg, p = self.cfg, f"layers.{i}."
        x = x + self._lin(o, p + "self_attn.o_proj")
        m = _norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        return x + self._lin(F.silu(self._lin(m, p + "mlp.gate_proj")) * self._lin(m, p + "mlp.up_proj"),
                             p + "mlp.down_proj")

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """[C, n·H] taps -> c [C, H] (FP32)."""
        return _norm(_mm(taps, self.w["fc.weight"]), self.w["hidden_norm.weight"], self.cfg.rms_norm_eps)

    def context_kv(self, c: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """c [C, H] at positions pos [C] -> per layer (keys after k_norm and RoPE, values), [C, kv heads, hd]."""
        cfg, out = self.cfg, []
        cs = _rope_cs(pos, cfg.head_dim, cfg.rope_theta)  # once for every layer (this runs inside the target's step)
        for i in range(cfg.num_layers):
            p = f"layers.{i}.self_attn."
            k = self._lin(c, p + "k_proj").view(-1, cfg.num_kv_heads, cfg.head_dim)
            k = _rotate(_norm(k, self.w[p + "k_norm.weight"], cfg.rms_norm_eps), cs)
            out.append((k, self._lin(c, p + "v_proj").view(-1, cfg.num_kv_heads, cfg.head_dim)))
        return out

    def hidden(self, ids: torch.Tensor, start, ctx_kv) -> torch.Tensor:
        """Blocks [anchor, masks...] (ids [Bk], or [A, Bk] for A blocks of one sequence) at positions start..
        (an int, or [A]) over that sequence's context keys and values; block a sees the context before its
        start and its own block (training packs a sequence's anchors this way) -> final-normed states [(A,) Bk, H]
        (FP32)."""
        cfg = self.cfg
        one = ids.dim() == 1
        ids = ids[None] if one else ids
        A, Bk = ids.shape
        g = cfg.num_heads // cfg.num_kv_heads
        st = (torch.full((A,), start, dtype=torch.long, device=ids.device) if isinstance(start, int)
              else torch.as_tensor(start, device=ids.device).reshape(-1).expand(A))
        pos = (st[:, None] + torch.arange(Bk, device=ids.device)).reshape(-1)  # [A·Bk]
        C = ctx_kv[0][0].shape[0]
        own = torch.arange(A, device=ids.device).repeat_interleave(Bk)
        see = torch.cat([torch.arange(C, device=ids.device)[None, :] < st.repeat_interleave(Bk)[:, None],
                         own[:, None] == own[None, :]], 1)  # [A·Bk, C + A·Bk]
        x = self.embed[ids.reshape(-1)].float() * cfg.input_embedding_scale
        N, cs = A * Bk, _rope_cs(pos, cfg.head_dim, cfg.rope_theta)
        for i, (kc, vc) in enumerate(ctx_kv):
            q, k, v = self._qkv(x, i, cs)
            K = torch.cat([kc, k]).repeat_interleave(g, 1)  # [C + N, heads, hd]: grouped-query attention
            V = torch.cat([vc, v]).repeat_interleave(g, 1)
            s = torch.einsum("qhd,khd->hqk", q, K) / math.sqrt(cfg.head_dim)
            s = s.masked_fill(~see[None], float("-inf"))
            x = self._finish(x, torch.einsum("hqk,khd->qhd", s.softmax(-1), V).reshape(N, -1), i)
        h = _norm(x, self.w["norm.weight"], cfg.rms_norm_eps).view(A, Bk, -1)
        return h[0] if one else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Block states [n, H] -> logits [n, V] (FP32), with z-lab's multiplier and soft cap where configured."""
        cfg = self.cfg
        x = _mm(h, self.lm_head) * cfg.output_multiplier
        cap = cfg.final_logit_softcapping
        return torch.tanh(x / float(cap)) * float(cap) if cap and float(cap) > 0 else x

    def block_batch(self, anchors: torch.Tensor, starts: torch.Tensor, ctx, valid: torch.Tensor | None) -> torch.Tensor:
        """B blocks [anchor, masks...] of B sequences, block b at positions starts[b].., each over its own context:
        ctx per layer (keys, values) [B, L, kv heads, hd] with valid [B, L] (the positions before its start), or a
        PagedContext read in place by kernels/drafter_attn.py (valid unused) -> final-normed states [B, Bk, H]
        (FP32). A block sees its context and its whole own block."""
        cfg = self.cfg
        B, Bk, dev = anchors.shape[0], cfg.block_size, anchors.device
        ids = torch.full((B, Bk), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        pos = (starts[:, None] + torch.arange(Bk, device=dev)).reshape(-1)  # [B·Bk]
        cs = _rope_cs(pos, cfg.head_dim, cfg.rope_theta)
        paged = isinstance(ctx, PagedContext)
        if paged:
            from ..kernels.drafter_attn import block_attention
        see = None if paged else torch.cat([valid, valid.new_ones(B, Bk)], 1)[:, None, None, None, :]  # [B,1,1,1,L+Bk]
        g, N = cfg.num_heads // cfg.num_kv_heads, B * Bk
        x = self.embed[ids.reshape(-1)].float() * cfg.input_embedding_scale
        for i in range(cfg.num_layers):
            q, k, v = self._qkv(x, i, cs)
            # grouped-query attention by kv head (query heads h = kv head · g + j), the context read in its own
            # dtype: no widened or head-repeated copy of the gathered keys and values
            qg = q.view(B, Bk, cfg.num_kv_heads, g, cfg.head_dim)
            ko, vo = k.view(B, Bk, cfg.num_kv_heads, -1), v.view(B, Bk, cfg.num_kv_heads, -1)
            if paged:
                o = block_attention(qg, ko, vo, ctx.kv, i, ctx.tables, ctx.lens, ctx.block_size).reshape(N, -1)
            else:
                kc, vc = ctx[i]
                sc = torch.cat([torch.einsum("bqkgd,blkd->bkgql", qg.to(kc.dtype), kc).float(),
                                torch.einsum("bqkgd,blkd->bkgql", qg, ko)], -1)
                pr = (sc / math.sqrt(cfg.head_dim)).masked_fill(~see, float("-inf")).softmax(-1)
                L = kc.shape[1]
                o = (torch.einsum("bkgql,blkd->bqkgd", pr[..., :L].to(vc.dtype), vc).float()
                     + torch.einsum("bkgql,blkd->bqkgd", pr[..., L:], vo)).reshape(N, -1)
            x = self._finish(x, o, i)
        return _norm(x, self.w["norm.weight"], cfg.rms_norm_eps).view(B, Bk, -1)

    def draft_batch(self, anchors: torch.Tensor, starts: torch.Tensor, ctx, valid: torch.Tensor, k: int):
        """block_batch's B blocks drafted on the device, nothing read back: (drafts [B, k] long, confidences
        [B, k] or None, the draft slots' logits [B, k, V]); k at most the block's drafts."""
        cfg = self.cfg
        h = self.block_batch(anchors, starts, ctx, valid)
        h = (h if cfg.shifted else h[:, 1:])[:, :k]
        logits = self.logits(h)
        if not cfg.markov_rank and not cfg.confidence:
            return logits.argmax(-1), None, logits
        # each slot's bias reads the previous slot's draft, so the slots are drawn in order, all B at once; the
        # draws stay on the device (index_select with the previous drafts as a tensor)
        out, conf, rows, prev = [], [], [], anchors
        for j in range(h.shape[1]):
            lj = logits[:, j]
            e = self.w["markov_head.markov_w1.weight"].index_select(0, prev).float() if cfg.markov_rank else None
            if cfg.markov_rank:
                lj = lj + _mm(e, self.w["markov_head.markov_w2.weight"])
            if cfg.confidence:
                z = torch.cat([h[:, j], e], -1) if cfg.markov_rank and cfg.confidence_with_markov else h[:, j]
                conf.append(torch.sigmoid(self._lin(z, "confidence_head.proj"))[:, 0])
            prev = lj.argmax(-1)
            out.append(prev)
            rows.append(lj)
        if not rows:
            return logits.argmax(-1), (logits.new_zeros(h.shape[:2]) if cfg.confidence else None), logits
        return (torch.stack(out, 1), torch.stack(conf, 1) if cfg.confidence else None, torch.stack(rows, 1))

    def draft_tensors(self, anchor: int, start: int, ctx_kv, k: int):
        """draft() on the device: (drafts [n] long, confidences [n] or None, logits [n, V]), nothing read back."""
        dev = self.embed.device
        C = ctx_kv[0][0].shape[0]
        d, c, logits = self.draft_batch(torch.full((1,), anchor, dtype=torch.long, device=dev),
                                        torch.full((1,), start, dtype=torch.long, device=dev),
                                        [(kk[None], vv[None]) for kk, vv in ctx_kv],
                                        (torch.arange(C, device=dev) < start)[None], k)
        return d[0], (None if c is None else c[0]), logits[0]

    def draft(self, anchor: int, start: int, ctx_kv, k: int) -> tuple[list[int], list[float] | None, torch.Tensor]:
        """Up to k greedy drafts after the anchor token at position start, the confidences (DSpark) or None,
        and the draft slots' logits [k, V] (FP32); one read back to the host."""
        d, c, logits = self.draft_tensors(anchor, start, ctx_kv, k)
        drafts, confs = read_back([(d, c)])[0]
        return drafts, confs, logits


def read_back(drafted: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[tuple[list[int], list[float] | None]]:
    """Drafts and confidences of several blocks in one device-to-host copy (FP64: token ids are exact)."""
    if not drafted:
        return []
    flat = torch.cat([t.double() for d, c in drafted for t in ((d,) if c is None else (d, c))]).tolist()
    out, i = [], 0
    for d, c in drafted:
        n = d.numel()
        ids, i = [int(x) for x in flat[i:i + n]], i + n
        conf = None
        if c is not None:
            conf, i = flat[i:i + n], i + n
        out.append((ids, conf))
    return out


def drafter_dir(name: str | Path) -> Path:
    """A drafter folder: the path itself, or a folder shipped beside the presets (peregrine-tiny-dspark)."""
    from ..config import PRESET_DIR
    p = Path(name)
    return p if p.is_dir() or p.is_absolute() else (PRESET_DIR / p if (PRESET_DIR / p).is_dir() else p)


def load_folder(folder: str | Path) -> tuple[DFlashConfig, dict]:
    """(config, weights on the CPU) of a drafter folder: config.json and *.safetensors."""
    from safetensors.torch import load_file
    p = drafter_dir(folder)
    if not (p / "config.json").is_file():
        raise ConfigError(f"drafter folder {folder}: no config.json")
    try:
        d = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"drafter folder {folder}: config.json is not valid JSON ({e.msg})") from None
    cfg = DFlashConfig.from_dict(d, f"drafter {folder}")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"drafter folder {folder}: no *.safetensors")
    weights = {}
    for f in files:
        weights |= {k.removeprefix("model."): v for k, v in load_file(str(f)).items()}
    return cfg, weights


def check_fits(cfg: DFlashConfig, weights: dict, model: DFlashModel, target_cfg, where: str) -> None:
    """A clear error where the drafter is not for this target: hidden size, tapped layers, vocabulary, tensors."""
    H = target_cfg.hidden_size
    if cfg.hidden_size != H:
        raise ConfigError(f"{where}: hidden size {cfg.hidden_size}, the target's is {H}")
    n = target_cfg.num_hidden_layers
    if cfg.num_target_layers is not None and int(cfg.num_target_layers) != n:
        raise ConfigError(f"{where}: drafts for a {cfg.num_target_layers}-layer target, this one has {n} layers")
    bad = [L for L in cfg.target_layer_ids if not -1 <= L < n]
    if bad or not cfg.target_layer_ids:
        raise ConfigError(f"{where}: target_layer_ids {cfg.target_layer_ids} outside the target's layers -1..{n - 1}")
    V = target_cfg.vocab_size
    if cfg.vocab_size is not None and int(cfg.vocab_size) != V:
        raise ConfigError(f"{where}: vocabulary {cfg.vocab_size}, the target's is {V}")
    if not 0 <= cfg.mask_token_id < V:
        raise ConfigError(f"{where}: mask_token_id {cfg.mask_token_id} outside the target's vocabulary ({V})")
    for name, shape in model.names().items():
        t = weights.get(name)
        if t is None:
            raise ConfigError(f"{where}: missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ConfigError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in weights and tuple(weights[name].shape) != (V, H):
            raise ConfigError(f"{where}: {name} has shape {tuple(weights[name].shape)}, expected {(V, H)}")


def check_room(cfg: DFlashConfig, slots: int, dtype, free: int | None, where) -> int:
    """The bytes of TapWriter's buffer (each drafter layer's key and value for every cache slot); a clear error
    where more than `free` (None: not checked, the CPU)."""
    need = slots * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    if free is not None and need > free:
        raise ConfigError(f"drafter {where}: its keys and values for the cache's {slots} token slots need "
                          f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free: lower --max-model-len "
                          "or --max-num-seqs")
    return need


class TapWriter:
    """Installed on the target model (KimiModel.taps): its forward hands over the residual stream after the tapped
    layers (take); from them the drafter's context c of every token the target is fed, and from c each drafter
    layer's key and value at the token's position, are written at the token's cache slot (step.slot_mapping), in
    a paged buffer beside the KV cache. Any path that feeds tokens (prefill pieces, decode, verify, graphs) keeps
    it, a rejected draft's entry is overwritten when its position is fed again, and a propose reads any batch's
    contexts from it at once (gather) with nothing kept per request."""

    def __init__(self, model: DFlashModel, num_slots: int, dtype, device):
        cfg = model.cfg
        self.model, self.layers = model, list(cfg.target_layer_ids)
        # [layer, key / value, slot, kv heads, hd]
        self.kv = torch.zeros(cfg.num_layers, 2, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.parts: dict[int, torch.Tensor] = {}
        # every layer's key and value projections as one weight (and its k_norm weights stacked): take() runs in
        # each target step, where context_kv's per-layer GEMMs, norms, rotations and writes were ~10 launches a layer
        w, L = model.w, range(cfg.num_layers)
        proj = [f"layers.{i}.self_attn.{n}_proj" for i in L for n in "kv"]
        self.w_kv = torch.cat([w[p + ".weight"] for p in proj])
        self.b_kv = torch.cat([w[p + ".bias"] for p in proj]).float() if cfg.attention_bias else None
        self.k_norm = torch.stack([w[f"layers.{i}.self_attn.k_norm.weight"] for i in L]).float()[:, None, :]

    def take(self, layer: int, x: torch.Tensor, step) -> None:
        """layer: the target layer whose output x [N, H] is (-1: the embedding)."""
        if layer not in self.layers:
            return
        self.parts[layer] = x
        if len(self.parts) == len(set(self.layers)):
            taps = torch.cat([self.parts[L] for L in self.layers], -1)
            self.parts = {}
            self.kv[:, :, step.slot_mapping] = self.context_kv(self.model.context(taps), step.positions)

    def context_kv(self, c: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """DFlashModel.context_kv for every layer at once -> [layers, 2, C, kv heads, hd] in the buffer's dtype."""
        cfg = self.model.cfg
        y = _mm(c, self.w_kv)
        y = (y if self.b_kv is None else y + self.b_kv).view(-1, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = _rope_cs(pos, cfg.head_dim, cfg.rope_theta)
        k = F.rms_norm(y[:, :, 0], (cfg.head_dim,), None, cfg.rms_norm_eps) * self.k_norm
        k = _rotate(k, (cos[:, None], sin[:, None]))
        return torch.stack([k, y[:, :, 1]]).permute(2, 0, 1, 3, 4).to(self.kv.dtype)

    def gather(self, tables: torch.Tensor, lens: torch.Tensor, L: int, block_size: int):
        """Contexts of B sequences: block tables [B, blocks] and fed lengths [B] (device tensors), L >= the
        longest -> per layer (keys, values) [B, L, kv heads, hd], and valid [B, L] (position < its length)."""
        pos = torch.arange(L, device=tables.device)
        valid = pos[None, :] < lens[:, None]
        slots = tables.gather(1, (pos // block_size)[None].expand(tables.shape[0], -1).clamp(max=tables.shape[1] - 1))
        slots = torch.where(valid, slots * block_size + pos % block_size, 0)
        kv = self.kv[:, :, slots]  # [layers, 2, B, L, kv heads, hd]
        return [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])], valid
