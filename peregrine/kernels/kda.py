"""KDA decode for one layer step (docs/models.md "KDA layer", steps 2-6 up to W_o).

Grid (B, H, split): a program owns sequence b, head h and a BLOCK_V-wide slice of the
value channels, i.e. a [d, BLOCK_V] column block of the head's FP32 state S[K, V], for
all T positions (T = 1 + speculative tokens). The update is column-local: decay of the
rows, Sᵀk and Sᵀq reduce over K, and q, k, the gate are recomputed per program from the
raw conv inputs (a few KB from L2). V is split because the state is the bytes: one
program per head (32 at B = 1) leaves most SMs idle while each pulls 64 KB serially.

Two things are per head, not per slice: the output RMSNorm over all V and the in-place
update of the q/k conv state (every slice reads it). A "finisher" does both once per (b, h):
  split 1          the program itself, o in registers;
  finish "last"    the last program of the head to arrive (an atomic counter per (b, h),
                   reset by it) reads the o slices back from an FP32 scratch;
  finish "launch"  a second small kernel over (B, H) reading the same scratch.
Every other state column / conv channel has exactly one writer, so the in-place cache
updates need no other cross-program sync. State layout: state[slot, h, K, V] (row = key
channel), as in peregrine/cache.py. Configs per (H, d, B) come from kda_plan.json
(`python -m peregrine.bench.kernels_kda --tune`), else `heuristic`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import read_plan_entries
from .pdl import launch_kwargs, pdl_wait

SOFTPLUS_LINEAR = tl.constexpr(20.0)  # softplus(x) == x in FP32 beyond this; avoids exp overflow
SIGMOID_MIN_ARG = tl.constexpr(-80.0)  # σ(-80) ~ 2e-35: the bounded gate's decay is exp(-5·2e-35) = 1.0 either way,
#                                        and σ's exp(-x) stays finite (the interpreter warns on inf)
INLINE, LAST, LAUNCH = 0, 1, 2  # finisher modes (see the module docstring)
FINISH_MODES = {"last": LAST, "launch": LAUNCH}
MIN_BLOCK_V = 4         # narrowest V slice a config may ask for (smaller ones are clamped)
HEUR_MIN_BLOCK_V = 16   # 64 B of each state row per program: whole 32 B sectors, few redundant q/k convs
HEUR_MAX_BLOCK_V = 32   # [128, 32] FP32 = 32 state registers per thread at 4 warps: no spills
TARGET_WAVES = 2        # heuristic: at least two programs per SM to hide HBM latency
CPU_SMS = 8             # pretend SM count off-GPU: keeps interpreter grids small
COUNTERS_MIN = 4096     # per-(b, h) arrival counters allocated at once (16 KB), grown by doubling
FINISH_WARPS = 4        # the finisher kernel handles one [d] vector per position
PLAN_PATH = Path(__file__).with_name("kda_plan.json")


@dataclass(frozen=True)
class KdaConfig:
    split: int = 1          # programs per head along V (power of 2); BLOCK_V = next_pow2(d) / split
    num_warps: int = 4
    num_stages: int = 1     # only the T loop could pipeline; kept for the tuner
    finish: str = "last"    # "last" or "launch" (ignored at split 1)


@triton.jit
def _raw(x_ptr, cs_ptr, ch, m, i, stride_t, stride_cj, W: tl.constexpr):
    """Raw input of channels `ch` at position i (i < 0: from the conv state), as FP32."""
    a = tl.load(x_ptr + i * stride_t + ch, mask=m & (i >= 0), other=0.0).to(tl.float32)
    c = tl.load(cs_ptr + (W - 1 + i) * stride_cj + ch, mask=m & (i < 0), other=0.0).to(tl.float32)
    return a + c


@triton.jit
def _conv_silu(x_ptr, cs_ptr, cw_ptr, stride_cw, ch, m, t, stride_t, stride_cj, W: tl.constexpr):
    acc = tl.zeros(ch.shape, tl.float32)
    for j in tl.static_range(W):  # tap j multiplies x[t - (W-1) + j]
        w = tl.load(cw_ptr + ch * stride_cw + j, mask=m, other=0.0).to(tl.float32)
        acc += w * _raw(x_ptr, cs_ptr, ch, m, t - (W - 1) + j, stride_t, stride_cj, W)
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_after(x_ptr, cs_ptr, ch, m, n, stride_t, stride_cj, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """The conv state after n positions (the last W-1 raw inputs, oldest first): [BLOCK_W, BLOCK_D]."""
    j = tl.arange(0, BLOCK_W)[:, None]
    i = n - (W - 1) + j
    mj = (j < W - 1) & m[None, :]
    a = tl.load(x_ptr + i * stride_t + ch[None, :], mask=mj & (i >= 0), other=0.0).to(tl.float32)
    c = tl.load(cs_ptr + (W - 1 + i) * stride_cj + ch[None, :], mask=mj & (i < 0), other=0.0).to(tl.float32)
    return a + c


@triton.jit
def _store_conv(dst_ptr, stride_dj, x, ch, m, W: tl.constexpr, BLOCK_W: tl.constexpr):
    j = tl.arange(0, BLOCK_W)[:, None]
    tl.store(dst_ptr + j * stride_dj + ch[None, :], x.to(dst_ptr.dtype.element_ty), mask=(j < W - 1) & m[None, :])


@triton.jit
def _finish_head(x_b, cs, r, onw, osc, out, cck, pb, h, T, H, D,
                 s_qkv_t, s_cs_j, s_r_b, s_r_t, s_os_b, s_os_t, s_o_b, s_o_t, s_cck_b, s_cck_t, s_cck_j, eps_o,
                 W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, CKPT: tl.constexpr):
    """Per head, after every V slice is done: RMSNorm + σ(r) gate of o (from the FP32 scratch)
    for all T positions, the q/k conv checkpoints, and the in-place q/k conv state update."""
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    ch_q = h * D + offs
    ch_k = H * D + ch_q
    nw = tl.load(onw + offs, mask=m, other=0.0).to(tl.float32)
    for t in range(T):
        o = tl.load(osc + pb * s_os_b + t * s_os_t + ch_q, mask=m, other=0.0, cache_modifier=".cg")
        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps_o) * nw
        rg = tl.load(r + pb * s_r_b + t * s_r_t + ch_q, mask=m, other=0.0).to(tl.float32)
        tl.store(out + pb * s_o_b + t * s_o_t + ch_q, (o * tl.sigmoid(rg)).to(out.dtype.element_ty), mask=m)
        if CKPT:
            ck = cck + pb.to(tl.int64) * s_cck_b + t * s_cck_t
            for g2 in tl.static_range(2):  # q, k channel groups of this head
                chg = ch_q + g2 * H * D
                cw = _conv_after(x_b, cs, chg, m, t + 1, s_qkv_t, s_cs_j, W, BLOCK_W)
                _store_conv(ck, s_cck_j, cw, chg, m, W, BLOCK_W)
    nq = _conv_after(x_b, cs, ch_q, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    nk = _conv_after(x_b, cs, ch_k, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    tl.debug_barrier()  # in place: read every old entry before any thread overwrites one
    _store_conv(cs, s_cs_j, nq, ch_q, m, W, BLOCK_W)
    _store_conv(cs, s_cs_j, nk, ch_k, m, W, BLOCK_W)


# slots: a view into the step's flat index tensor, 8- or 16-byte aligned by the row: one compile for both
@triton.jit(do_not_specialize_on_alignment=["slots"])
def _kda_decode_kernel(
    qkv, f, bl, r, conv_w, A_log, dt_bias, onw, state, conv_state, slots, out, sck, cck, osc, counters,
    T, H, D,
    s_qkv_b, s_qkv_t, s_f_b, s_f_t, s_b_b, s_b_t, s_r_b, s_r_t, s_o_b, s_o_t, s_cw,
    s_st_s, s_st_h, s_st_k, s_cs_s, s_cs_j,
    s_sck_b, s_sck_t, s_sck_h, s_sck_k, s_cck_b, s_cck_t, s_cck_j, s_os_b, s_os_t,
    lower_bound, eps_qk, eps_o, q_scale,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, SPLIT: tl.constexpr,
    FINISH: tl.constexpr, SOFTPLUS: tl.constexpr, CKPT: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pb = tl.program_id(0)
    h = tl.program_id(1)
    pv = tl.program_id(2)
    HD = H * D
    offs = tl.arange(0, BLOCK_D)          # key channels (rows): all of them
    m = offs < D
    ov = pv * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value channels (columns)
    mv = ov < D
    ch_q = h * D + offs
    ch_k = HD + ch_q
    ch_v = 2 * HD + h * D + ov
    # Weights first (safe before the PDL wait); state, conv state, slots and inputs are all
    # written by earlier kernels of this step or the previous one, so they load after it.
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    dtb = tl.load(dt_bias + ch_q, mask=m, other=0.0).to(tl.float32)
    nw = tl.load(onw + ov, mask=mv, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    slot = tl.load(slots + pb).to(tl.int64)

    x_b = qkv + pb.to(tl.int64) * s_qkv_b
    cs = conv_state + slot * s_cs_s
    st = state + slot * s_st_s + h * s_st_h
    sp = st + offs[:, None] * s_st_k + ov[None, :]
    m2 = m[:, None] & mv[None, :]
    S = tl.load(sp, mask=m2, other=0.0)

    for t in range(T):
        q = _conv_silu(x_b, cs, conv_w, s_cw, ch_q, m, t, s_qkv_t, s_cs_j, W)
        k = _conv_silu(x_b, cs, conv_w, s_cw, ch_k, m, t, s_qkv_t, s_cs_j, W)
        v = _conv_silu(x_b, cs, conv_w, s_cw, ch_v, mv, t, s_qkv_t, s_cs_j, W)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps_qk) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps_qk)

        g = tl.load(f + pb * s_f_b + t * s_f_t + ch_q, mask=m, other=0.0).to(tl.float32) + dtb
        if SOFTPLUS:
            sp_g = tl.where(g > SOFTPLUS_LINEAR, g, tl.log(1.0 + tl.exp(tl.minimum(g, SOFTPLUS_LINEAR))))
            gam = -a * sp_g
        else:
            gam = lower_bound * tl.sigmoid(tl.maximum(a * g, SIGMOID_MIN_ARG))
        beta = tl.sigmoid(tl.load(bl + pb * s_b_b + t * s_b_t + h).to(tl.float32))

        S = S * tl.exp(gam)[:, None]                  # decay rows (key channels)
        ks = tl.sum(k[:, None] * S, axis=0)           # Sᵀk over this V slice
        u = beta * (v - ks)
        S = S + k[:, None] * u[None, :]
        o = tl.sum(q[:, None] * S, axis=0)            # Sᵀq over this V slice

        if FINISH == 0:  # the whole head is here: norm and gate in registers
            o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps_o) * nw
            rg = tl.load(r + pb * s_r_b + t * s_r_t + h * D + ov, mask=mv, other=0.0).to(tl.float32)
            tl.store(out + pb * s_o_b + t * s_o_t + h * D + ov, (o * tl.sigmoid(rg)).to(out.dtype.element_ty), mask=mv)
        else:
            tl.store(osc + pb * s_os_b + t * s_os_t + h * D + ov, o, mask=mv)

        if CKPT:
            sk = sck + pb.to(tl.int64) * s_sck_b + t * s_sck_t + h * s_sck_h
            tl.store(sk + offs[:, None] * s_sck_k + ov[None, :], S, mask=m2)
            ck = cck + pb.to(tl.int64) * s_cck_b + t * s_cck_t
            cw = _conv_after(x_b, cs, ch_v, mv, t + 1, s_qkv_t, s_cs_j, W, BLOCK_W)
            _store_conv(ck, s_cck_j, cw, ch_v, mv, W, BLOCK_W)
            if FINISH == 0:
                for g2 in tl.static_range(2):  # q, k channel groups of this head
                    chg = ch_q + g2 * HD
                    cw = _conv_after(x_b, cs, chg, m, t + 1, s_qkv_t, s_cs_j, W, BLOCK_W)
                    _store_conv(ck, s_cck_j, cw, chg, m, W, BLOCK_W)

    tl.store(sp, S, mask=m2)
    # In place: read every old entry before any thread overwrites one. Only this program
    # reads its v channels; the q/k ones belong to the finisher unless it is this program.
    nv = _conv_after(x_b, cs, ch_v, mv, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    if FINISH == 0:
        nq = _conv_after(x_b, cs, ch_q, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
        nk = _conv_after(x_b, cs, ch_k, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    tl.debug_barrier()
    _store_conv(cs, s_cs_j, nv, ch_v, mv, W, BLOCK_W)
    if FINISH == 0:
        _store_conv(cs, s_cs_j, nq, ch_q, m, W, BLOCK_W)
        _store_conv(cs, s_cs_j, nk, ch_k, m, W, BLOCK_W)
    if FINISH == 1:
        # Every thread's scratch stores precede the counter's release (bar.sync, then one
        # acq_rel atomic: the grid-sync pattern); the last arrival then sees all slices.
        tl.debug_barrier()
        cnt = tl.atomic_add(counters + pb * H + h, 1, sem="acq_rel", scope="gpu")
        if cnt == SPLIT - 1:
            _finish_head(x_b, cs, r, onw, osc, out, cck, pb, h, T, H, D,
                         s_qkv_t, s_cs_j, s_r_b, s_r_t, s_os_b, s_os_t, s_o_b, s_o_t, s_cck_b, s_cck_t, s_cck_j,
                         eps_o, W, BLOCK_W, BLOCK_D, CKPT)
            tl.atomic_xchg(counters + pb * H + h, 0)  # ready for the next launch (graph replay)


@triton.jit(do_not_specialize_on_alignment=["slots"])
def _kda_finish_kernel(qkv, r, onw, conv_state, slots, out, cck, osc, T, H, D,
                       s_qkv_b, s_qkv_t, s_cs_s, s_cs_j, s_r_b, s_r_t, s_os_b, s_os_t, s_o_b, s_o_t,
                       s_cck_b, s_cck_t, s_cck_j, eps_o,
                       W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, CKPT: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # o slices in the scratch come from the decode kernel just before
    pb = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + pb).to(tl.int64)
    _finish_head(qkv + pb.to(tl.int64) * s_qkv_b, conv_state + slot * s_cs_s, r, onw, osc, out, cck, pb, h, T, H, D,
                 s_qkv_t, s_cs_j, s_r_b, s_r_t, s_os_b, s_os_t, s_o_b, s_o_t, s_cck_b, s_cck_t, s_cck_j, eps_o,
                 W, BLOCK_W, BLOCK_D, CKPT)


def _check(qkv, f, b, r, conv_w, state, conv_state, slots, state_ckpt, conv_ckpt):
    B, T, C3 = qkv.shape
    H = b.shape[-1]
    d = C3 // (3 * H)
    W = conv_w.shape[-1]
    assert C3 == 3 * H * d and f.shape == (B, T, H * d) and r.shape == (B, T, H * d) and b.shape == (B, T, H)
    assert state.shape[1:] == (H, d, d) and state.dtype == torch.float32
    assert conv_state.shape[1:] == (W - 1, C3) and slots.shape == (B,)
    assert (state_ckpt is None) == (conv_ckpt is None), "give both checkpoint buffers or neither"
    if state_ckpt is not None:
        assert state_ckpt.shape == (B, T, H, d, d) and conv_ckpt.shape == (B, T, W - 1, C3)
    return B, T, H, d, W


# ---- configs: plan file, heuristic, validation ----

@functools.lru_cache(maxsize=None)
def _num_sms(device: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return CPU_SMS


def heuristic(H: int, D: int, B: int, device="cpu") -> KdaConfig:
    """No plan entry: V slices of 16..32 columns, enough programs for TARGET_WAVES per SM."""
    block_d = triton.next_power_of_2(D)
    split = max(1, block_d // HEUR_MAX_BLOCK_V)
    while B * H * split < TARGET_WAVES * _num_sms(str(device)) and block_d // (2 * split) >= HEUR_MIN_BLOCK_V:
        split *= 2
    return KdaConfig(split=split)


def is_valid(c: KdaConfig) -> bool:
    pow2 = lambda x: isinstance(x, int) and x >= 1 and x & (x - 1) == 0  # noqa: E731
    return pow2(c.split) and pow2(c.num_warps) and c.num_warps <= 32 and isinstance(c.num_stages, int) \
        and 1 <= c.num_stages <= 8 and c.finish in FINISH_MODES


@functools.lru_cache(maxsize=None)
def load_plan(path: str | None = None) -> dict:
    """{(H, D, B): KdaConfig} from the plan file; a missing or unreadable file or a bad entry is skipped."""
    plan = {}
    for key, e in read_plan_entries(Path(path) if path else PLAN_PATH).items():
        try:
            H, D, B = (int(x) for x in key.split(","))
            c = KdaConfig(split=e["split"], num_warps=e["num_warps"], num_stages=e.get("num_stages", 1),
                          finish=e.get("finish", "last"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if is_valid(c):
            plan[(H, D, B)] = c
    return plan


def plan_key(H: int, D: int, B: int) -> str:
    return f"{H},{D},{B}"


def lookup(H: int, D: int, B: int, device="cpu", path: str | None = None) -> KdaConfig:
    """The plan's entry for B, else for the nearest planned batch above (then below) it, else the heuristic."""
    plan = load_plan(path)
    batches = sorted(b for (h, d, b) in plan if (h, d) == (H, D))
    if not batches:
        return heuristic(H, D, B, device)
    pick = next((b for b in batches if b >= B), batches[-1])
    return plan[(H, D, pick)]


_COUNTERS: dict = {}  # device -> int32 arrival counters, all zero between launches; never freed (graphs hold them)


def _counters(device: torch.device, n: int):
    bufs = _COUNTERS.setdefault(str(device), [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None  # a buffer zeroed inside a capture is zero only on replay: use the launch finisher
    bufs.append(torch.zeros(max(n, 2 * bufs[-1].numel() if bufs else COUNTERS_MIN), dtype=torch.int32, device=device))
    return bufs[-1]


def kda_decode(qkv, f, b, r, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, slots, *,
               gate="softplus", lower_bound=-5.0, eps_qk=1e-6, eps_o=1e-5, out=None,
               state_ckpt=None, conv_ckpt=None, num_warps=None, config: KdaConfig | None = None):
    """One KDA layer step for B sequences × T positions; updates state/conv_state in place.

    qkv [B,T,3Hd], f/r [B,T,Hd], b [B,T,H] may be strided views of one GEMM output
    (last dim contiguous). Returns o [B,T,Hd] (before W_o) in qkv's dtype (or `out`).
    `config` overrides the plan lookup; `num_warps` overrides its warps.
    """
    assert gate in ("softplus", "bounded")
    conv_w = conv_w.reshape(conv_w.shape[0], -1)  # accept the checkpoint's [C,1,W]
    B, T, H, d, W = _check(qkv, f, b, r, conv_w, state, conv_state, slots, state_ckpt, conv_ckpt)
    A_log = A_log.reshape(-1).contiguous()
    conv_w, dt_bias, o_norm_w = conv_w.contiguous(), dt_bias.contiguous(), o_norm_w.contiguous()
    if out is None:
        out = torch.empty(B, T, H * d, dtype=qkv.dtype, device=qkv.device)
    for x in (qkv, f, b, r, out):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    assert state.stride(-1) == 1 and conv_state.stride(-1) == 1
    ckpt = state_ckpt is not None
    sck = state_ckpt if ckpt else state
    cck = conv_ckpt if ckpt else conv_state
    if ckpt:
        assert state_ckpt.stride(-1) == 1 and conv_ckpt.stride(-1) == 1
    if B == 0:
        return out
    cfg = config or lookup(H, d, B, qkv.device)
    if num_warps:
        cfg = replace(cfg, num_warps=num_warps)
    assert is_valid(cfg), f"bad KDA config {cfg}"
    BLOCK_D = triton.next_power_of_2(d)
    split = min(cfg.split, max(1, BLOCK_D // MIN_BLOCK_V))
    finish = INLINE if split == 1 else FINISH_MODES[cfg.finish]
    counters = _counters(qkv.device, B * H) if finish == LAST else None
    if finish == LAST and counters is None:
        finish = LAUNCH
    osc = out if finish == INLINE else torch.empty(B, T, H * d, dtype=torch.float32, device=qkv.device)
    BLOCK_W = triton.next_power_of_2(W - 1)
    _kda_decode_kernel[(B, H, split)](
        qkv, f, b, r, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, slots, out, sck, cck, osc,
        counters if counters is not None else slots,
        T, H, d,
        qkv.stride(0), qkv.stride(1), f.stride(0), f.stride(1), b.stride(0), b.stride(1),
        r.stride(0), r.stride(1), out.stride(0), out.stride(1), conv_w.stride(0),
        state.stride(0), state.stride(1), state.stride(2), conv_state.stride(0), conv_state.stride(1),
        sck.stride(0), sck.stride(1), sck.stride(2), sck.stride(3) if ckpt else 0,
        cck.stride(0), cck.stride(1), cck.stride(2) if ckpt else 0, osc.stride(0), osc.stride(1),
        float(lower_bound), float(eps_qk), float(eps_o), d ** -0.5,
        W=W, BLOCK_W=BLOCK_W, BLOCK_D=BLOCK_D, BLOCK_V=BLOCK_D // split, SPLIT=split, FINISH=finish,
        SOFTPLUS=gate == "softplus", CKPT=ckpt, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_kwargs(qkv.device),
    )
    if finish == LAUNCH:
        _kda_finish_kernel[(B, H)](
            qkv, r, o_norm_w, conv_state, slots, out, cck, osc, T, H, d,
            qkv.stride(0), qkv.stride(1), conv_state.stride(0), conv_state.stride(1), r.stride(0), r.stride(1),
            osc.stride(0), osc.stride(1), out.stride(0), out.stride(1),
            cck.stride(0), cck.stride(1), cck.stride(2) if ckpt else 0, float(eps_o),
            W=W, BLOCK_W=BLOCK_W, BLOCK_D=BLOCK_D, CKPT=ckpt, num_warps=FINISH_WARPS,
            **launch_kwargs(qkv.device),
        )
    return out


def kda_decode_ref(qkv, f, b, r, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, slots, *,
                   gate="softplus", lower_bound=-5.0, eps_qk=1e-6, eps_o=1e-5, out=None,
                   state_ckpt=None, conv_ckpt=None, num_warps=None, config=None):
    """Plain FP32 PyTorch, straight from docs/models.md; same in-place effects as kda_decode
    (num_warps and config are accepted and ignored, so both take the same arguments)."""
    conv_w = conv_w.reshape(conv_w.shape[0], -1).float()
    B, T, H, d, W = _check(qkv, f, b, r, conv_w, state, conv_state, slots, state_ckpt, conv_ckpt)
    a = A_log.reshape(-1).float().exp()                        # [H]
    res = torch.empty(B, T, H * d, dtype=torch.float32, device=qkv.device)
    for i in range(B):
        s = int(slots[i])
        hist = torch.cat([conv_state[s], qkv[i]], 0)           # raw inputs, oldest first [W-1+T, C]
        S = state[s].clone()                                   # [H, K, V]
        for t in range(T):
            win = hist[t:t + W].float()                        # x[t-(W-1)] .. x[t]
            y = (win.T * conv_w).sum(-1)                       # [C]
            y = y * torch.sigmoid(y)
            q, k, v = y.view(3, H, d)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps_qk) * d ** -0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps_qk)
            g = (f[i, t].float() + dt_bias.float()).view(H, d)
            if gate == "softplus":
                gam = -a[:, None] * F.softplus(g)
            else:
                gam = lower_bound * torch.sigmoid(a[:, None] * g)
            beta = torch.sigmoid(b[i, t].float())              # [H]
            S = S * gam.exp()[:, :, None]
            u = beta[:, None] * (v - (S * k[:, :, None]).sum(1))  # no matmul: no TF32 on GPU
            S = S + k[:, :, None] * u[:, None, :]
            o = (S * q[:, :, None]).sum(1)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps_o) * o_norm_w.float()
            res[i, t] = (o * torch.sigmoid(r[i, t].float().view(H, d))).reshape(-1)
            if state_ckpt is not None:
                state_ckpt[i, t] = S
                conv_ckpt[i, t] = hist[t + 1:t + W]
        state[s] = S
        conv_state[s] = hist[T:T + W - 1]
    if out is None:
        return res.to(qkv.dtype)
    out.copy_(res)
    return out
