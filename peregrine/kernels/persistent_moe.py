"""Persistent MoE decode block (issue #20 prototype): router, top-k, routed experts, the shared
expert and the combine in ONE launch whose programs pull tasks from a queue in dependency order.

Tasks (a table built on the host per (shapes, B, order); kinds below):
  ROUTER(j)       logits[:, j-tile] = x Wrᵀ (FP32)                            -> c_router += 1
  SHARED_UP(n)    hs[:, n-tile] = silu(x Wgᵀ) · (x Wuᵀ)                        -> c_sup += 1
  TOPK(b)         waits c_router; token b: σ(logit) + bias, top-k -> ids, w    -> c_topk[b] += 1
  UP(b, j, n)     waits c_topk[b]; h[b, j, n-tile] = silu(W1_e x_b) · (W3_e x_b) -> c_up[b, j] += 1
  SHARED_DOWN(m)  loads its weight tile, then waits c_sup; part[:, k, m-tile]   -> c_down[m's combine tile] += 1
  DOWN(b, j, m)   waits c_topk[b], loads W2_e's tile, then waits c_up[b, j];
                  part[b, j, m-tile] = w[b, j] · W2_e h[b, j]                   -> c_down[m's combine tile] += 1
  COMBINE(c)      waits c_down[c]; out[:, c-tile] = Σ_j part[:, j] (+ shared), fixed order

Dependencies are as narrow as the data: a token's experts start once its own top-k is done, an
assignment's down tiles once its own up tiles are, a combine tile once the down tiles it sums are
(session 8 measured a first version whose waits were whole phases: 5x slower than the chain).

Dependency counters live in global memory and only grow: a task signals with a release atomic
after a CTA barrier, a waiter polls with acquire atomics until counter ≥ epoch · expected. The
epoch is read from device memory at the start of a launch and bumped by the program that draws
the launch's last ticket (every program draws until its ticket passes the table, so a launch
draws exactly N + P tickets): nothing is zeroed between launches, and a CUDA graph can replay it.
Waits are bounded: after MAX_SPINS polls a waiter records its task number + 1 in the error word
(atomic max) and goes on, so a missing dependency gives wrong numbers and a flag, never a hang.

A queue (not a static split) keeps the schedule deadlock-free on the GPU: tickets are drawn in
table order, so whatever a task waits on was drawn earlier by a running program. Under the Triton
interpreter programs run one after another: program 0 draws every task in table order, so any
table in dependency order completes, and one that is not trips the error word.

Prototype limits: SwiGLU, no latent (K3) experts, B ≤ BLOCK_B tokens, one expert read per
(token, slot) assignment (the chain kernels in moe.py read a shared expert once per step).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROUTER, SHARED_UP, TOPK, UP, SHARED_DOWN, DOWN, COMBINE = range(7)
BLOCK_B = 8          # token rows per tile: decode batches up to 8 (the prototype's scope)
BLOCK_N = 16         # output rows per router / shared-up / down task: D / 16 = 144 down tasks per assignment at 48B
BLOCK_K = 64         # reduction chunk of the B-token tiles (their [BLOCK_B, BLOCK_N, BLOCK_K] products sit in registers)
BLOCK_NU = 32        # output rows per routed up task (one token): gate and up tiles of 32 x BLOCK_KU
BLOCK_KU = 128       # its reduction chunk: 16 KB of weights in flight per step of the loop (the first version: 2 KB)
BLOCK_M = 256        # columns per combine task (a multiple of BLOCK_N)
MAX_SPINS = 1 << 20  # polls before a wait gives up and flags the error word
CPU_PROGRAMS = 4     # programs off-GPU (the interpreter runs them one after another)
NUM_WARPS = 8


@triton.jit
def _wait(cnt_ptr, slot, target, err_ptr, task, MAX_SPINS: tl.constexpr):
    v = tl.atomic_add(cnt_ptr + slot, 0, sem="acquire")
    n = 0
    while (v < target) & (n < MAX_SPINS):
        v = tl.atomic_add(cnt_ptr + slot, 0, sem="acquire")
        n += 1
    if v < target:
        tl.atomic_max(err_ptr, task + 1)
    tl.debug_barrier()  # every thread of the program sees what the waited-on tasks stored


@triton.jit
def _signal(cnt_ptr, slot):
    tl.debug_barrier()  # every thread's stores of this task are issued before the release
    tl.atomic_add(cnt_ptr + slot, 1, sem="release")


@triton.jit
def _rows_x_tile(x_ptr, stride_x, B, w_ptr, stride_w, row0, n_rows, K,
                 BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_B, BLOCK_N] FP32: rows of x (B valid) times rows row0.. of W (n_rows valid), over K."""
    ob = tl.arange(0, BLOCK_B)
    on = row0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ob[:, None] * stride_x + ok[None, :], mask=(ob[:, None] < B) & (ok[None, :] < K), other=0.0)
        w = tl.load(w_ptr + on[:, None] * stride_w + ok[None, :], mask=(on[:, None] < row0 + n_rows) & (ok[None, :] < K),
                    other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    return acc


@triton.jit
def _row_x_tile(x_ptr, w_ptr, stride_w, row0, n_rows, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] FP32: one row x (K) times rows row0.. of W."""
    on = row0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ok, mask=ok < K, other=0.0)
        w = tl.load(w_ptr + on[:, None] * stride_w + ok[None, :], mask=(on[:, None] < row0 + n_rows) & (ok[None, :] < K),
                    other=0.0)
        acc += tl.sum(x.to(tl.float32)[None, :] * w.to(tl.float32), 1)
    return acc


@triton.jit
def _moe_block_kernel(task_ptr, n_tasks, queue_ptr, cnt_ptr, err_ptr, epoch_ptr,
                      x_ptr, wr_ptr, bias_ptr, w13_ptr, w2_ptr, ws13_ptr, ws2_ptr,
                      logits_ptr, ids_ptr, tw_ptr, h_ptr, hs_ptr, part_ptr, out_ptr,
                      B, D, E, I, IS, scaling, n_router, n_sup, n_up, c_topk, c_up, c_down,
                      TOP_K: tl.constexpr, NJ: tl.constexpr, RENORM: tl.constexpr, HAS_SHARED: tl.constexpr,
                      BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_NU: tl.constexpr, BLOCK_KU: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_IS: tl.constexpr, BLOCK_M: tl.constexpr,
                      MAX_SPINS: tl.constexpr):
    # NJ: partial slots per token, the routed ones then the shared expert. Counter slots: 0 router, 1 shared
    # up, c_topk + b, c_up + b·TOP_K + j (n_up tiles each), c_down + combine tile (NJ · its down tiles)
    R = BLOCK_M // BLOCK_N  # down tiles per combine tile
    n_dt = tl.cdiv(D, BLOCK_N)
    P = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)            # this launch's epoch (1, 2, ...): counters target epoch · expected
    base = (epoch - 1) * (n_tasks + P)    # tickets drawn by the earlier launches
    ob = tl.arange(0, BLOCK_B)
    t = tl.atomic_add(queue_ptr, 1) - base
    while t < n_tasks:
        kind = tl.load(task_ptr + 4 * t)
        p0 = tl.load(task_ptr + 4 * t + 1)
        p1 = tl.load(task_ptr + 4 * t + 2)
        p2 = tl.load(task_ptr + 4 * t + 3)
        if kind == 0:  # ROUTER(p0): FP32 logits of experts p0·BLOCK_N ..
            acc = _rows_x_tile(x_ptr, D, B, wr_ptr, D, p0 * BLOCK_N, E - p0 * BLOCK_N, D, BLOCK_B, BLOCK_N, BLOCK_K)
            on = p0 * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(logits_ptr + ob[:, None] * E + on[None, :], acc, mask=(ob[:, None] < B) & (on[None, :] < E))
            _signal(cnt_ptr, 0)
        elif kind == 1:  # SHARED_UP(p0)
            r0 = p0 * BLOCK_N
            g = _rows_x_tile(x_ptr, D, B, ws13_ptr, D, r0, IS - r0, D, BLOCK_B, BLOCK_N, BLOCK_K)
            u = _rows_x_tile(x_ptr, D, B, ws13_ptr + IS * D, D, r0, IS - r0, D, BLOCK_B, BLOCK_N, BLOCK_K)
            on = r0 + tl.arange(0, BLOCK_N)
            tl.store(hs_ptr + ob[:, None] * IS + on[None, :], g * tl.sigmoid(g) * u, mask=(ob[:, None] < B) & (on[None, :] < IS))
            _signal(cnt_ptr, 1)
        elif kind == 2:  # TOPK(b=p0): σ(logit) + bias, top-k of one token (ties: the lowest expert index)
            _wait(cnt_ptr, 0, epoch * n_router, err_ptr, t, MAX_SPINS)
            oe = tl.arange(0, BLOCK_E)
            e_ok = oe < E
            bias = tl.load(bias_ptr + oe, mask=e_ok, other=0.0)
            s = tl.sigmoid(tl.load(logits_ptr + p0 * E + oe, mask=e_ok, other=0.0))
            sc = tl.where(e_ok, s + bias, float("-inf"))
            total = 0.0
            for j in tl.static_range(TOP_K):
                best = tl.max(sc, 0)
                e = tl.min(tl.where(sc == best, oe, BLOCK_E), 0)
                w = tl.sum(tl.where(oe == e, s, 0.0), 0)
                tl.store(ids_ptr + p0 * TOP_K + j, e)
                tl.store(tw_ptr + p0 * TOP_K + j, w)
                total += w
                sc = tl.where(oe == e, float("-inf"), sc)
            tl.debug_barrier()
            if RENORM:
                for j in tl.static_range(TOP_K):
                    w = tl.load(tw_ptr + p0 * TOP_K + j)
                    tl.store(tw_ptr + p0 * TOP_K + j, w / total * scaling)
            else:
                for j in tl.static_range(TOP_K):
                    w = tl.load(tw_ptr + p0 * TOP_K + j)
                    tl.store(tw_ptr + p0 * TOP_K + j, w * scaling)
            _signal(cnt_ptr, c_topk + p0)
        elif kind == 3:  # UP(b=p0, slot=p1, tile=p2)
            _wait(cnt_ptr, c_topk + p0, epoch, err_ptr, t, MAX_SPINS)
            e = tl.load(ids_ptr + p0 * TOP_K + p1).to(tl.int64)
            r0 = p2 * BLOCK_NU
            w1 = w13_ptr + e * (2 * I) * D
            g = _row_x_tile(x_ptr + p0 * D, w1, D, r0, I - r0, D, BLOCK_NU, BLOCK_KU)
            u = _row_x_tile(x_ptr + p0 * D, w1 + I * D, D, r0, I - r0, D, BLOCK_NU, BLOCK_KU)
            on = r0 + tl.arange(0, BLOCK_NU)
            tl.store(h_ptr + (p0 * TOP_K + p1) * I + on, g * tl.sigmoid(g) * u, mask=on < I)
            _signal(cnt_ptr, c_up + p0 * TOP_K + p1)
        elif kind == 4:  # SHARED_DOWN(p0): the weight tile first, then the wait
            on = p0 * BLOCK_N + tl.arange(0, BLOCK_N)
            oi = tl.arange(0, BLOCK_IS)
            wt = tl.load(ws2_ptr + on[:, None] * IS + oi[None, :], mask=(on[:, None] < D) & (oi[None, :] < IS), other=0.0)
            _wait(cnt_ptr, 1, epoch * n_sup, err_ptr, t, MAX_SPINS)
            for b in range(B):
                hv = tl.load(hs_ptr + b * IS + oi, mask=oi < IS, other=0.0)
                y = tl.sum(hv[None, :] * wt.to(tl.float32), 1)
                tl.store(part_ptr + (b * NJ + TOP_K) * D + on, y, mask=on < D)
            _signal(cnt_ptr, c_down + p0 // R)
        elif kind == 5:  # DOWN(b=p0, slot=p1, tile=p2): W2_e's tile once the expert is known, then h
            _wait(cnt_ptr, c_topk + p0, epoch, err_ptr, t, MAX_SPINS)
            e = tl.load(ids_ptr + p0 * TOP_K + p1).to(tl.int64)
            on = p2 * BLOCK_N + tl.arange(0, BLOCK_N)
            oi = tl.arange(0, BLOCK_I)
            wt = tl.load(w2_ptr + e * D * I + on[:, None] * I + oi[None, :], mask=(on[:, None] < D) & (oi[None, :] < I),
                         other=0.0)
            _wait(cnt_ptr, c_up + p0 * TOP_K + p1, epoch * n_up, err_ptr, t, MAX_SPINS)
            hv = tl.load(h_ptr + (p0 * TOP_K + p1) * I + oi, mask=oi < I, other=0.0)
            w = tl.load(tw_ptr + p0 * TOP_K + p1)
            y = tl.sum(hv[None, :] * wt.to(tl.float32), 1) * w
            tl.store(part_ptr + (p0 * NJ + p1) * D + on, y, mask=on < D)
            _signal(cnt_ptr, c_down + p2 // R)
        else:  # COMBINE(p0): Σ over the slots in slot order, the shared expert last
            _wait(cnt_ptr, c_down + p0, epoch * NJ * tl.minimum(R, n_dt - p0 * R), err_ptr, t, MAX_SPINS)
            om = p0 * BLOCK_M + tl.arange(0, BLOCK_M)
            for b in range(B):
                acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for j in range(NJ):
                    acc += tl.load(part_ptr + (b * NJ + j) * D + om, mask=om < D, other=0.0)
                tl.store(out_ptr + b * D + om, acc.to(out_ptr.dtype.element_ty), mask=om < D)
        t = tl.atomic_add(queue_ptr, 1) - base
    if t == n_tasks + P - 1:  # the launch's last ticket: every program has read the epoch
        tl.atomic_add(epoch_ptr, 1)


@dataclass
class Shapes:
    B: int
    D: int
    E: int
    I: int
    IS: int          # shared expert width (0: none)
    top_k: int


def task_table(s: Shapes) -> tuple[list[tuple[int, int, int, int]], dict]:
    """Tasks in a dependency order (data-independent work first) and the expected signal counts."""
    cdiv = triton.cdiv
    router = [(ROUTER, j, 0, 0) for j in range(cdiv(s.E, BLOCK_N))]
    sup = [(SHARED_UP, n, 0, 0) for n in range(cdiv(s.IS, BLOCK_N))] if s.IS else []
    topk = [(TOPK, b, 0, 0) for b in range(s.B)]
    up = [(UP, b, j, n) for b in range(s.B) for j in range(s.top_k) for n in range(cdiv(s.I, BLOCK_NU))]
    sdown = [(SHARED_DOWN, m, 0, 0) for m in range(cdiv(s.D, BLOCK_N))] if s.IS else []
    down = [(DOWN, b, j, m) for b in range(s.B) for j in range(s.top_k) for m in range(cdiv(s.D, BLOCK_N))]
    comb = [(COMBINE, m, 0, 0) for m in range(cdiv(s.D, BLOCK_M))]
    tasks = router + sup + topk + up + sdown + down + comb
    return tasks, {"router": len(router), "sup": len(sup), "up": cdiv(s.I, BLOCK_NU)}


def counter_slots(s: Shapes) -> dict:
    """Where each counter lives: router, shared up, then per token, per assignment, per combine tile."""
    topk = 2
    up = topk + s.B
    down = up + s.B * s.top_k
    return {"topk": topk, "up": up, "down": down, "n": down + triton.cdiv(s.D, BLOCK_M)}


def expected_counts(s: Shapes, launches: int = 1) -> list[int]:
    """What every counter reads after `launches` launches (tests: nothing is zeroed in between)."""
    cdiv, nj = triton.cdiv, s.top_k + (1 if s.IS else 0)
    n_dt, r = cdiv(s.D, BLOCK_N), BLOCK_M // BLOCK_N
    per = [cdiv(s.E, BLOCK_N), cdiv(s.IS, BLOCK_N) if s.IS else 0] + [1] * s.B + [cdiv(s.I, BLOCK_NU)] * (s.B * s.top_k)
    per += [nj * min(r, n_dt - c * r) for c in range(cdiv(s.D, BLOCK_M))]
    return [launches * v for v in per]


def waits_on(t: tuple, u: tuple, s: Shapes) -> bool:
    """Whether task t waits (through a counter) for task u: the kernel's dependencies, as narrow as its data."""
    (kt, *pt), (ku, *pu) = t, u
    r = BLOCK_M // BLOCK_N
    if kt == TOPK:
        return ku == ROUTER
    if kt == UP:
        return ku == TOPK and pu[0] == pt[0]
    if kt == SHARED_DOWN:
        return ku == SHARED_UP
    if kt == DOWN:
        return (ku == TOPK and pu[0] == pt[0]) or (ku == UP and pu[:2] == pt[:2])
    if kt == COMBINE:
        return (ku == DOWN and pu[2] // r == pt[0]) or (ku == SHARED_DOWN and pu[0] // r == pt[0])
    return False


def random_order(tasks: list, s: Shapes, seed: int) -> list:
    """A random order of `tasks` that respects only the kernel's dependencies (waits_on): any task whose
    waits are met may come next."""
    rng = random.Random(seed)
    deps = {t: {u for u in tasks if waits_on(t, u, s)} for t in tasks}
    done, out, left = set(), [], list(tasks)
    while left:
        ready = [t for t in left if deps[t] <= done]
        t = ready[rng.randrange(len(ready))]
        out.append(t)
        done.add(t)
        left.remove(t)
    return out


class Workspace:
    """Scratch, counters, queue, epoch and error word of one MoE block's launches (reused: nothing is
    zeroed between launches)."""

    def __init__(self, s: Shapes, device, tasks: list | None = None, programs: int | None = None):
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.s = s
        table, self.expect = task_table(s)
        self.tasks = torch.tensor(tasks if tasks is not None else table, **i32).view(-1, 4)
        self.logits = torch.empty(s.B, s.E, **f32)
        self.ids = torch.empty(s.B, s.top_k, **i32)
        self.tw = torch.empty(s.B, s.top_k, **f32)
        self.h = torch.empty(s.B, s.top_k, s.I, **f32)
        self.hs = torch.empty(s.B, max(s.IS, 1), **f32)
        self.part = torch.empty(s.B, s.top_k + (1 if s.IS else 0), s.D, **f32)
        self.slots = counter_slots(s)
        self.counters = torch.zeros(self.slots["n"], **i32)
        self.queue = torch.zeros(1, **i32)
        self.err = torch.zeros(1, **i32)
        self.epoch = torch.ones(1, **i32)
        dev = torch.device(device)
        self.programs = programs or (torch.cuda.get_device_properties(dev).multi_processor_count
                                     if dev.type == "cuda" else CPU_PROGRAMS)

    def poison(self) -> None:
        for t in (self.logits, self.tw, self.h, self.hs, self.part):
            t.fill_(float("nan"))
        self.ids.fill_(-1)


def moe_block(x, gate_w, bias, w13, w2, shared_w13, shared_w2, ws: Workspace, *, renormalize=True,
              scaling=1.0, max_spins: int = MAX_SPINS, out=None):
    """out [B, D] = the MoE block of x [B, D] (router, top-k, SwiGLU experts, shared expert), one launch."""
    s = ws.s
    B, D = x.shape
    assert (B, D) == (s.B, s.D) and B <= BLOCK_B and x.is_contiguous()
    has_shared = shared_w13 is not None
    out = torch.empty(B, D, dtype=x.dtype, device=x.device) if out is None else out
    dummy = ws.hs
    _moe_block_kernel[(ws.programs,)](
        ws.tasks, ws.tasks.shape[0], ws.queue, ws.counters, ws.err, ws.epoch,
        x, gate_w, bias, w13, w2, shared_w13 if has_shared else dummy, shared_w2 if has_shared else dummy,
        ws.logits, ws.ids, ws.tw, ws.h, ws.hs, ws.part, out,
        B, D, s.E, s.I, s.IS, float(scaling), ws.expect["router"], ws.expect["sup"], ws.expect["up"],
        ws.slots["topk"], ws.slots["up"], ws.slots["down"],
        TOP_K=s.top_k, NJ=s.top_k + (1 if has_shared else 0), RENORM=renormalize, HAS_SHARED=has_shared, BLOCK_B=BLOCK_B,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_NU=BLOCK_NU, BLOCK_KU=BLOCK_KU,
        BLOCK_E=triton.next_power_of_2(s.E), BLOCK_I=triton.next_power_of_2(s.I),
        BLOCK_IS=triton.next_power_of_2(max(s.IS, 1)), BLOCK_M=BLOCK_M, MAX_SPINS=max_spins, num_warps=NUM_WARPS)
    return out


def moe_block_ref(x, gate_w, bias, w13, w2, shared_w13, shared_w2, top_k, renormalize=True, scaling=1.0):
    """FP32 PyTorch: the standard path's own MoE functions (models/moe.py), experts looped one by one."""
    from ..models.layers import swiglu
    from ..models.moe import grouped_experts, select
    xf = x.float()
    ids, w = select(xf @ gate_w.float().T, bias.float(), top_k, renormalize, scaling)
    y = grouped_experts(xf, w13.float(), w2.float(), ids, w, swiglu, grouped=False).float()
    if shared_w13 is not None:
        y += swiglu(xf @ shared_w13.float().T) @ shared_w2.float().T
    return y.to(x.dtype), ids
