"""A decode layer's GEMVs, router and experts encoded as the persistent kernel reads them: a weight pool of
[BN, BK] blocks, a task table, a fixed task list per CTA, and dependency counters (issue #46).

What the encoding commits to, and the CuTe kernel (kernels/cute/persistent_layer.py) and `interpret` below both follow:
- weights: every op's matrix cut into row tiles of BN (a gated op's tile: its gate rows' blocks, then its up rows'),
  each tile's K in blocks of BK stored consecutively, so one TMA descriptor over the pool [blocks * BN, BK] streams
  any task's weights, whatever its matrix's shape; an RMSNorm before a GEMV is folded into its columns here;
- activations: one FP32 scratch [B, S]; ops read and write column ranges of it; every column is written by at most
  one op (a step is single-assignment, so no write waits for a read); constants (the router's bias) sit in columns
  no op writes, loaded once (`load_consts`); expert ids are stored as FP32 values (exact below 2^24);
- a task is one row tile of one op (one (token, slot) assignment's tile for routed experts, the whole top-k for the
  router); it waits on the counter of each op that wrote what it reads until that counter reaches epoch x (that op's
  task count), and adds one to its own op's counter when its rows are stored. Counters are never zeroed: step n
  waits for n x tasks, compared by wrapped difference, so they may overflow. A routed expert's weights depend on the
  step: its producer waits on the router's counter (PWAIT) before streaming them, and only then;
- per CTA, a task list fixed here (the emulator's list schedule by weight bytes), in an order consistent with one
  global order, so a CTA never waits on a task queued behind it and the lists cannot deadlock while all CTAs are
  resident. A wait that does not end within the kernel's bound writes task id + 1 to the error word.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .emulator import check_schedule, schedule
from .tasks import LayerWeights, Region, Task, derive_deps

BN, BK = 64, 128     # a weight block: 64 rows x 128 values, 16 KB of BF16, one TMA copy
MAX_WAITS = 3        # ops a task's consumers may wait on (a KDA head: the in-projection and its two gate GEMVs)
EPS = 1e-5           # RMSNorm epsilon the kernel is compiled with (the 48B's and K3's rms_norm_eps)
GEMV, TOPK, EXPERT, COMBINE, KDA = range(5)   # task kinds
NORM, GATED, WEIGHTED, BOUNDED, PER_SLOT = 1, 2, 4, 8, 16  # flags: RMSNorm of the input, SwiGLU of gate and up rows,
#                      scale by the slot's weight; KDA: the bounded gate (else softplus); experts: input per slot
EPS_QK = 1e-6        # KDA's q / k L2-norm epsilon (kernels/kda.py)
# task table columns
(KIND, BLK0, KBLK, SRC, DST, SIGNAL, WAIT0, COUNT0, WAIT1, COUNT1, PWAIT, PCOUNT, FLAGS, TOKEN, SLOT, IDS, ESTRIDE,
 RESID, N_OUT, TOPK_K, EXTRA, WAIT2, COUNT2, HEAD, FCOL, BCOL, RCOL, PARAM) = range(28)
FIELDS = 28
WAITS = ((WAIT0, COUNT0), (WAIT1, COUNT1), (WAIT2, COUNT2))


@dataclass
class Gemv:
    """act[:, dst:dst + N] = f(act[:, src:src + K]) @ w.T (+ act[:, resid:resid + N]); gated: w is [2N, K], gate
    rows then up rows, and the output is silu(gate) * up; norm: the input RMS-normalized with this weight [K]."""
    name: str
    w: torch.Tensor
    src: int
    dst: int
    norm: torch.Tensor | None = None
    gated: bool = False
    resid: int | None = None


@dataclass
class TopK:
    """Per token: the router's top-k of sigmoid(logits) + bias over E logits at src (ties to the lower expert);
    writes k ids then their k sigmoid scores renormalized to sum 1 and times the routed scaling factor at dst. The
    bias lives at columns [bias, bias + E), the scaling factor at bias + E (constants)."""
    name: str
    src: int
    dst: int
    bias: int
    E: int
    k: int


@dataclass
class Experts:
    """Routed experts, one task per (token b, slot s) and row tile: e = act[b, ids + s]; x = act[b, src:src + K]
    (per_slot_in: act[b, src + s K : ...]); act[b, dst + s N : ...] = f(x) @ w[e].T, times act[b, ids + k + s] if
    weighted. w [E, N or 2N, K]; norm and gated as Gemv's."""
    name: str
    w: torch.Tensor
    src: int
    dst: int
    ids: int
    k: int
    norm: torch.Tensor | None = None
    gated: bool = False
    per_slot_in: bool = False
    weighted: bool = False


@dataclass
class Combine:
    """act[:, dst:dst + n] = act[:, resid:...] + act[:, extra:...] + sum over s < k of act[:, parts + s n : ...]"""
    name: str
    parts: int
    k: int
    n: int
    resid: int
    extra: int
    dst: int


@dataclass
class Kda:
    """The KDA recurrence, one task per head h (kernels/kda.py's decode, T = 1): q | k | v of the head from
    act[:, qkv:qkv + 3Hd] through the short convolution (its state `conv_state` [slots, W - 1, 3Hd]) and SiLU, the
    gate from act[:, f:f + Hd] (+ dt_bias), beta = sigmoid(act[:, b + h]), the state [slots, H, d, d] updated in
    place, the output's gated RMSNorm with act[:, r:r + Hd]; writes act[:, dst + h d : ...]. Its small weights
    (conv_w [3Hd, W], A_log [H], dt_bias [Hd], o_norm [d]) go to the table's FP32 params."""
    name: str
    qkv: int
    f: int
    b: int
    r: int
    dst: int
    conv_w: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: torch.Tensor
    lower_bound: float | None = None   # None: softplus gate

    @property
    def H(self) -> int:
        return self.A_log.numel()

    @property
    def d(self) -> int:
        return self.o_norm.numel()


@dataclass
class Table:
    pool: torch.Tensor      # [blocks * BN, BK] BF16
    tasks: torch.Tensor     # [T, FIELDS] int32
    lists: torch.Tensor     # [ctas, L] int32, -1 past each CTA's last task
    n_counters: int         # one per op
    width: int              # S: the activation scratch's columns
    tiles: list[int]        # tasks per op (a counter's count per epoch)
    B: int
    params: torch.Tensor    # FP32: the KDA ops' small weights (a task's PARAM field is its op's offset)


def _rows(op) -> int:
    """Output rows of one matrix (one expert's)."""
    return op.w.shape[-2] // (2 if op.gated else 1)


def _padded(op) -> int:
    """A GEMV's output columns: its rows rounded up to whole tiles (the in-projection's q|k|v|f|g|b is not), the
    extra rows' weights zero."""
    return -(-_rows(op) // BN) * BN


def _io(op, B: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """(column ranges it reads, column ranges it writes, its task count)."""
    if isinstance(op, Gemv):
        N, K = _padded(op), op.w.shape[-1]
        reads = [(op.src, op.src + K)] + ([(op.resid, op.resid + N)] if op.resid is not None else [])
        return reads, [(op.dst, op.dst + N)], N // BN
    if isinstance(op, Kda):
        Hd = op.H * op.d
        return [(op.qkv, op.qkv + 3 * Hd), (op.f, op.f + Hd), (op.b, op.b + op.H), (op.r, op.r + Hd)], \
            [(op.dst, op.dst + Hd)], op.H
    if isinstance(op, TopK):
        return [(op.src, op.src + op.E), (op.bias, op.bias + op.E + 1)], [(op.dst, op.dst + 2 * op.k)], 1
    if isinstance(op, Experts):
        N, K = _rows(op), op.w.shape[-1]
        reads = [(op.src, op.src + K * (op.k if op.per_slot_in else 1)), (op.ids, op.ids + 2 * op.k)]
        return reads, [(op.dst, op.dst + op.k * N)], B * op.k * (N // BN)
    reads = [(op.parts, op.parts + op.k * op.n), (op.resid, op.resid + op.n), (op.extra, op.extra + op.n)]
    return reads, [(op.dst, op.dst + op.n)], op.n // BN


def folded(op) -> torch.Tensor:
    """The op's weights as the pool holds them: BF16, its RMSNorm weight folded into the columns."""
    w = op.w if op.norm is None else op.w.float() * op.norm.float()
    return w.to(torch.bfloat16)


def _blocks(w: torch.Tensor, t: int, gated: bool) -> list[torch.Tensor]:
    """Row tile t of one matrix [N or 2N, K] as BK-wide blocks: its gate rows', then (gated) its up rows'."""
    N = w.shape[0] // (2 if gated else 1)
    parts = [w[t * BN:(t + 1) * BN]] + ([w[N + t * BN:N + (t + 1) * BN]] if gated else [])
    return [p[:, k * BK:(k + 1) * BK] for p in parts for k in range(w.shape[1] // BK)]


def encode(ops: list, width: int, ctas: int, B: int = 1) -> Table:
    """The pool, task table and per-CTA lists for `ops` at B tokens (ops in an order where each one's inputs are
    written by earlier ops or are the step's inputs and constants) over an activation scratch of `width` columns."""
    io = [_io(op, B) for op in ops]
    for j, (op, (reads, writes, _)) in enumerate(zip(ops, io)):
        if hasattr(op, "w") and ((_rows(op) % BN and (op.gated or isinstance(op, Experts))) or op.w.shape[-1] % BK):
            raise ValueError(f"{op.name}: W is {tuple(op.w.shape)}; rows must be a multiple of {BN} and columns "
                             f"of {BK}")
        if isinstance(op, Combine) and op.n % BN:
            raise ValueError(f"{op.name}: {op.n} columns, not a multiple of {BN}")
        if isinstance(op, TopK) and op.k > op.E:
            raise ValueError(f"{op.name}: top-{op.k} of {op.E}")
        for lo, hi in reads + writes:
            if lo < 0 or hi > width:
                raise ValueError(f"{op.name}: columns [{lo}, {hi}) outside the scratch's {width}")
        if any(r0 < w1 and w0 < r1 for r0, r1 in reads for w0, w1 in writes):
            raise ValueError(f"{op.name}: reads the columns it writes")
        for i in range(j):
            if any(a0 < b1 and b0 < a1 for a0, a1 in writes for b0, b1 in io[i][1]):
                raise ValueError(f"{op.name}: writes columns {ops[i].name} already wrote (a step is single-assignment)")
    tiles = [n for _, _, n in io]
    tasks: list[Task] = []
    fields: list[list[int]] = []
    blocks: list[torch.Tensor] = []
    params: list[torch.Tensor] = []
    nblk, nparam = 0, 0
    for j, op in enumerate(ops):
        reads = io[j][0]
        waits = [i for i in range(len(ops)) if i != j and any(r0 < w1 and w0 < r1 for r0, r1 in reads
                                                              for w0, w1 in io[i][1])]
        if any(i > j for i in waits):
            raise ValueError(f"{op.name} reads what a later op ({ops[max(waits)].name}) writes: list the ops in the "
                             "order they run")
        if len(waits) > MAX_WAITS:
            raise ValueError(f"{op.name} reads the outputs of {len(waits)} ops; a task waits on at most {MAX_WAITS}")
        pwait = -1
        if isinstance(op, Experts):
            pwait = next((i for i in waits if any(w0 < op.ids + op.k and op.ids < w1 for w0, w1 in io[i][1])), -1)
        base = [0] * FIELDS
        base[SIGNAL], base[PWAIT], base[PCOUNT] = j, pwait, tiles[pwait] if pwait >= 0 else 0
        for (wf, cf), i in zip(WAITS, waits + [-1] * (MAX_WAITS - len(waits))):
            base[wf], base[cf] = i, tiles[i] if i >= 0 else 0
        # the schedule waits for whole ops, as the counters do, not only for the tiles a task reads
        sched_reads = tuple(Region("act", lo, hi) for i in waits + ([pwait] if pwait >= 0 else [])
                            for lo, hi in io[i][1])
        mine: list[tuple[list[int], tuple[int, int], int]] = []  # (fields, columns written, weight bytes)
        if isinstance(op, (Gemv, Experts)):
            N, K, g = _rows(op), op.w.shape[-1], 2 if op.gated else 1
            w = folded(op)
            flags = (NORM if op.norm is not None else 0) | (GATED if op.gated else 0)
            nb = BN * K * g * 2
            if isinstance(op, Gemv):
                if N % BN:
                    w = torch.cat([w, w.new_zeros(_padded(op) - N, K)])
                    N = _padded(op)
                for t in range(N // BN):
                    f = base.copy()
                    f[KIND], f[BLK0], f[KBLK], f[FLAGS], f[N_OUT] = GEMV, nblk, K // BK, flags, N
                    f[SRC], f[DST] = op.src, op.dst + t * BN
                    f[RESID] = op.resid + t * BN if op.resid is not None else -1
                    blocks += _blocks(w, t, op.gated)
                    mine.append((f, (f[DST], f[DST] + BN), nb))
                    nblk += g * K // BK
            else:
                per_expert = (N // BN) * g * K // BK
                for e in range(w.shape[0]):
                    for t in range(N // BN):
                        blocks += _blocks(w[e], t, op.gated)
                for b in range(B):
                    for s in range(op.k):
                        for t in range(N // BN):
                            f = base.copy()
                            f[KIND], f[BLK0], f[KBLK], f[ESTRIDE] = EXPERT, nblk + t * g * K // BK, K // BK, per_expert
                            # the slot's columns are found at run time: the task serves every token that chose
                            # its expert, if it is that expert's first (token, slot) (kernels/moe.py's schedule)
                            f[SRC], f[DST], f[TOKEN], f[SLOT] = op.src, op.dst + t * BN, b, s
                            f[IDS], f[TOPK_K] = op.ids, op.k
                            f[FLAGS] = flags | (WEIGHTED if op.weighted else 0) | (PER_SLOT if op.per_slot_in else 0)
                            f[N_OUT] = N
                            mine.append((f, (op.dst + s * N + t * BN, op.dst + s * N + (t + 1) * BN), nb))
                nblk += w.shape[0] * per_expert
        elif isinstance(op, Kda):
            Hd = op.H * op.d
            for h in range(op.H):
                f = base.copy()
                f[KIND], f[SRC], f[DST], f[HEAD], f[N_OUT], f[PARAM] = KDA, op.qkv, op.dst + h * op.d, h, Hd, nparam
                f[FCOL], f[BCOL], f[RCOL] = op.f, op.b, op.r
                f[FLAGS] = BOUNDED if op.lower_bound is not None else 0
                f[EXTRA], f[TOPK_K] = op.d, op.conv_w.shape[1]  # the head's width, the convolution's
                mine.append((f, (f[DST], f[DST] + op.d), op.conv_w.shape[1] * 3 * op.d * 4))
            part = [op.conv_w.float().flatten(), op.A_log.float().flatten(), op.dt_bias.float().flatten(),
                    op.o_norm.float().flatten(), op.A_log.new_full((1,), op.lower_bound or 0.0).float()]
            params += part
            nparam += sum(x.numel() for x in part)
        elif isinstance(op, TopK):
            f = base.copy()
            f[KIND], f[SRC], f[DST], f[RESID], f[N_OUT], f[TOPK_K] = TOPK, op.src, op.dst, op.bias, op.E, op.k
            mine.append((f, (op.dst, op.dst + 2 * op.k), 0))
        else:
            for t in range(op.n // BN):
                f = base.copy()
                f[KIND], f[SRC], f[DST], f[RESID] = COMBINE, op.parts + t * BN, op.dst + t * BN, op.resid + t * BN
                f[EXTRA], f[N_OUT], f[TOPK_K] = op.extra + t * BN, op.n, op.k
                mine.append((f, (f[DST], f[DST] + BN), 0))
        for n, (f, (lo, hi), nb) in enumerate(mine):
            fields.append(f)
            tasks.append(Task(f"{op.name}[{n}]", lambda s: None, sched_reads, (Region("act", lo, hi),), nb))
    derive_deps(tasks)
    lists, start = schedule(tasks, ctas)
    check_schedule(tasks, lists)
    L = max(1, max(len(x) for x in lists))
    lst = torch.full((ctas, L), -1, dtype=torch.int32)
    for c, x in enumerate(lists):
        x = sorted(x, key=lambda i: (start[i], i))
        lst[c, :len(x)] = torch.tensor(x, dtype=torch.int32)
    pool = torch.cat(blocks) if blocks else torch.zeros(BN, BK, dtype=torch.bfloat16)
    par = torch.cat(params) if params else torch.zeros(1)
    return Table(pool, torch.tensor(fields, dtype=torch.int32), lst, len(ops), width, tiles, B, par)


def _gemv(x, w, flags):
    """x [M, K] FP32 through one matrix's folded BF16 weights [N or 2N, K]: the op's math, FP32."""
    y = x @ w.float().T
    if flags & NORM:
        y = y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    if flags & GATED:
        g, u = y.chunk(2, -1)
        y = torch.nn.functional.silu(g) * u
    return y


def _select(logits, consts, k):
    """consts: the bias [.., E] then the scaling factor."""
    s = torch.sigmoid(logits)
    ids = torch.sort(s + consts[:, :-1], dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * consts[:, -1:]


def _kda(qkv, f, b, r, conv_w, A_log, dt_bias, o_norm, lower_bound, st: dict):
    """kernels/kda.py's FP32 decode reference, one token each, over the states in st (updated in place)."""
    from ..kernels.kda import kda_decode_ref
    return kda_decode_ref(qkv[:, None], f[:, None], b[:, None], r[:, None], conv_w, A_log, dt_bias, o_norm, st["state"],
                          st["conv_state"], st["slots"], gate="softplus" if lower_bound is None else "bounded",
                          lower_bound=-5.0 if lower_bound is None else lower_bound, eps_qk=EPS_QK, eps_o=EPS)[:, 0]


def reference(ops: list, act: torch.Tensor, kda: dict | None = None) -> torch.Tensor:
    """The ops in FP32, one after another as whole tensors, from the weights the pool holds (`folded`): the scratch
    after the step. Independent of the table: no tiles, no pool layout, no task order. kda: the KDA ops' state,
    conv_state and slots (updated in place)."""
    act = act.clone()
    for op in ops:
        if isinstance(op, Kda):
            Hd = op.H * op.d
            act[:, op.dst:op.dst + Hd] = _kda(act[:, op.qkv:op.qkv + 3 * Hd], act[:, op.f:op.f + Hd],
                                              act[:, op.b:op.b + op.H], act[:, op.r:op.r + Hd], op.conv_w, op.A_log,
                                              op.dt_bias, op.o_norm, op.lower_bound, kda)
            continue
        if isinstance(op, Gemv):
            N, K = _rows(op), op.w.shape[-1]
            flags = (NORM if op.norm is not None else 0) | (GATED if op.gated else 0)
            y = _gemv(act[:, op.src:op.src + K], folded(op), flags)
            act[:, op.dst:op.dst + N] = y + (act[:, op.resid:op.resid + N] if op.resid is not None else 0)
            P = _padded(op)  # the op owns its columns up to whole tiles: zero rows' outputs (plus the residual's)
            act[:, op.dst + N:op.dst + P] = act[:, op.resid + N:op.resid + P] if op.resid is not None else 0.0
        elif isinstance(op, TopK):
            ids, w = _select(act[:, op.src:op.src + op.E], act[:, op.bias:op.bias + op.E + 1], op.k)
            act[:, op.dst:op.dst + op.k], act[:, op.dst + op.k:op.dst + 2 * op.k] = ids.float(), w
        elif isinstance(op, Experts):
            N, K = _rows(op), op.w.shape[-1]
            flags = (NORM if op.norm is not None else 0) | (GATED if op.gated else 0)
            w = folded(op)
            for b in range(act.shape[0]):
                for s in range(op.k):
                    lo = op.src + (s * K if op.per_slot_in else 0)
                    y = _gemv(act[b:b + 1, lo:lo + K], w[int(act[b, op.ids + s])], flags)[0]
                    act[b, op.dst + s * N:op.dst + (s + 1) * N] = y * (act[b, op.ids + op.k + s] if op.weighted else 1)
        else:
            parts = act[:, op.parts:op.parts + op.k * op.n].reshape(-1, op.k, op.n).sum(1)
            act[:, op.dst:op.dst + op.n] = act[:, op.resid:op.resid + op.n] + act[:, op.extra:op.extra + op.n] + parts
    return act


def _run(tb: Table, t: int, act: torch.Tensor, pool: torch.Tensor, kda: dict | None) -> None:
    """One task of the table, as the kernel's consumers compute it (FP32, on the CPU)."""
    f = tb.tasks[t].tolist()
    kind, src, dst, flags = f[KIND], f[SRC], f[DST], f[FLAGS]
    if kind == KDA:  # one head, its weights read from the params at the task's offset
        h, Hd, d, W, p0 = f[HEAD], f[N_OUT], f[EXTRA], f[TOPK_K], f[PARAM]
        H = Hd // d
        conv = tb.params[p0:p0 + 3 * Hd * W].view(3 * Hd, W)
        a_log = tb.params[p0 + 3 * Hd * W:p0 + 3 * Hd * W + H]
        dtb = tb.params[p0 + 3 * Hd * W + H:p0 + 3 * Hd * W + H + Hd]
        onorm = tb.params[p0 + 3 * Hd * W + H + Hd:p0 + 3 * Hd * W + H + Hd + d]
        lb = float(tb.params[p0 + 3 * Hd * W + H + Hd + d]) if flags & BOUNDED else None
        cols = torch.cat([torch.arange(h * d, (h + 1) * d) + j * Hd for j in range(3)])  # q, k, v of head h
        c = slice(h * d, (h + 1) * d)
        st = {"state": kda["state"][:, h:h + 1], "conv_state": kda["conv_state"][:, :, cols], "slots": kda["slots"]}
        o = _kda(act[:, src + cols], act[:, f[FCOL] + h * d:f[FCOL] + (h + 1) * d], act[:, f[BCOL] + h:f[BCOL] + h + 1],
                 act[:, f[RCOL] + h * d:f[RCOL] + (h + 1) * d], conv[cols], a_log[h:h + 1], dtb[c], onorm, lb, st)
        kda["state"][:, h:h + 1] = st["state"]
        kda["conv_state"][:, :, cols] = st["conv_state"]
        act[:, dst:dst + d] = o
    elif kind == EXPERT:  # the expert's first (token, slot) serves every token that chose it; the others do nothing
        k, ids = f[TOPK_K], act[:, f[IDS]:f[IDS] + f[TOPK_K]].long()
        e = int(ids[f[TOKEN], f[SLOT]])
        if bool((ids.flatten()[:f[TOKEN] * k + f[SLOT]] == e).any()):
            return
        g = 2 if flags & GATED else 1
        b0 = f[BLK0] + e * f[ESTRIDE]
        w = torch.cat([torch.cat([pool[(b0 + h * f[KBLK] + j) * BN:(b0 + h * f[KBLK] + j + 1) * BN]
                                  for j in range(f[KBLK])], 1) for h in range(g)])
        K = f[KBLK] * BK
        for b, s in (ids == e).nonzero().tolist():
            lo = src + (s * K if flags & PER_SLOT else 0)
            y = _gemv(act[b:b + 1, lo:lo + K], w, flags)[0]
            if flags & WEIGHTED:
                y = y * act[b, f[IDS] + k + s]
            act[b, dst + s * f[N_OUT]:dst + s * f[N_OUT] + BN] = y
    elif kind == GEMV:
        rows = slice(None)
        b0 = f[BLK0]
        g = 2 if flags & GATED else 1
        parts = [torch.cat([pool[(b0 + h * f[KBLK] + k) * BN:(b0 + h * f[KBLK] + k + 1) * BN]
                            for k in range(f[KBLK])], 1) for h in range(g)]
        y = _gemv(act[rows, src:src + f[KBLK] * BK], torch.cat(parts), flags)
        if f[RESID] >= 0:
            y = y + act[:, f[RESID]:f[RESID] + BN]
        act[rows, dst:dst + BN] = y
    elif kind == TOPK:
        E, k = f[N_OUT], f[TOPK_K]
        ids, w = _select(act[:, src:src + E], act[:, f[RESID]:f[RESID] + E + 1], k)
        act[:, dst:dst + k], act[:, dst + k:dst + 2 * k] = ids.float(), w
    else:
        parts = sum(act[:, src + s * f[N_OUT]:src + s * f[N_OUT] + BN] for s in range(f[TOPK_K]))
        act[:, dst:dst + BN] = act[:, f[RESID]:f[RESID] + BN] + act[:, f[EXTRA]:f[EXTRA] + BN] + parts


def interpret(tb: Table, act: torch.Tensor, counters: torch.Tensor, epoch: int,
              rng: random.Random | None = None, kda: dict | None = None) -> int:
    """Run the encoded table as the CTAs would, on the CPU: at each point one CTA whose next task's waits (its
    producer's too) are met runs that task (drawn by rng, else the lowest CTA), reading its weights from the
    pool's blocks. Returns the error word: 0, or the id + 1 of a task still waiting when no CTA can go on (where the
    kernel's bounded wait would fire). `act`, `counters` (int64) and the KDA states in `kda` are updated in place."""
    pc = [0] * tb.lists.shape[0]
    pool = tb.pool.float()

    def next_task(c):
        return int(tb.lists[c, pc[c]]) if pc[c] < tb.lists.shape[1] else -1

    def ready(t):
        f = tb.tasks[t].tolist()
        return all(f[w] < 0 or int(counters[f[w]]) - epoch * f[n] >= 0
                   for w, n in WAITS + ((PWAIT, PCOUNT),))
    while True:
        live = [c for c in range(len(pc)) if next_task(c) >= 0]
        if not live:
            return 0
        go = [c for c in live if ready(next_task(c))]
        if not go:
            return min(next_task(c) for c in live) + 1
        c = rng.choice(go) if rng else go[0]
        t = next_task(c)
        _run(tb, t, act, pool, kda)
        counters[int(tb.tasks[t, SIGNAL])] += 1
        pc[c] += 1


def streamed_blocks(tb: Table, act: torch.Tensor) -> int:
    """Weight blocks the producers stream for a step whose router wrote its ids into `act`: every GEMV tile's, and
    each routed expert's once (its first (token, slot) streams it, the others nothing)."""
    n = 0
    for f in tb.tasks.tolist():
        g = 2 if f[FLAGS] & GATED else 1
        if f[KIND] == GEMV:
            n += g * f[KBLK]
        elif f[KIND] == EXPERT:
            ids = act[:, f[IDS]:f[IDS] + f[TOPK_K]].long().flatten()
            j = f[TOKEN] * f[TOPK_K] + f[SLOT]
            n += g * f[KBLK] * int(not bool((ids[:j] == ids[j]).any()))
    return n


def load_consts(act: torch.Tensor, consts: dict[int, torch.Tensor]) -> None:
    """Write the constant columns (the router's bias) into every token's row of the scratch."""
    for col, v in consts.items():
        act[:, col:col + v.numel()] = v.float()


def dense_chain(D: int, Hd: int, Is: int, make) -> tuple[list[Gemv], int]:
    """A KDA layer's dense GEMVs as one dependent chain, for the kernel's tests and benchmark: the in-projection's
    q | k | v [3Hd, D] from x, the output projection [D, Hd] over v, the shared expert's up [2Is, D] and down
    [D, Is] (no norm or activation between: the GEMVs only). make(N, K) gives a weight. -> (ops, scratch width)"""
    x, qkv = 0, D
    a = qkv + 3 * Hd
    up = a + D
    out = up + 2 * Is
    ops = [Gemv("in_proj", make(3 * Hd, D), x, qkv), Gemv("o_proj", make(D, Hd), qkv + 2 * Hd, a),
           Gemv("shared_up", make(2 * Is, D), a, up), Gemv("shared_down", make(D, Is), up, out)]
    return ops, out + D


def moe_block(post_norm, gate_w, bias, w13, w2, shared13, shared2, k: int, scaling: float, src: int = 0,
              base: int | None = None):
    """A MoE block from the residual after attention (columns [src, src + D)) to the layer's output, its own
    columns from `base` (default: after the residual): RMSNorm folded into the router, routed up and shared up;
    top-k (its weights times the scaling factor, a constant beside the bias); routed experts up (SwiGLU) and down
    (times the slot's weight); the shared expert; one combine. -> (ops, width, consts, output column)"""
    E, D = gate_w.shape
    I, Is = w2.shape[2], shared2.shape[1]
    c0 = src + D if base is None else base  # [c0, c0 + E] holds the bias and the scaling factor
    logits = c0 + E + 1
    sel = logits + -(-E // BN) * BN  # the router's rows padded to whole tiles
    hbuf = sel + 2 * k
    parts = hbuf + k * I
    sh = parts + k * D
    shout = sh + Is
    out = shout + D
    ops = [Gemv("router", gate_w, src, logits, norm=post_norm), TopK("topk", logits, sel, c0, E, k),
           Experts("up", w13, src, hbuf, sel, k, norm=post_norm, gated=True),
           Experts("down", w2, hbuf, parts, sel, k, per_slot_in=True, weighted=True),
           Gemv("shared_up", shared13, src, sh, norm=post_norm, gated=True), Gemv("shared_down", shared2, sh, shout),
           Combine("combine", parts, k, D, src, shout, out)]
    return ops, out + D, {c0: torch.cat([bias.float().flatten(), bias.new_full((1,), float(scaling)).float()])}, out


def kda_layer(w, scaling: float = 1.0):
    """One KDA decoder layer with its MoE block (persistent/tasks.py's LayerWeights), from its input residual
    (columns [0, D)) to its output: the in-projection (input RMSNorm folded), the two gate low-ranks, the KDA
    recurrence per head, the output projection plus the residual, then moe_block. -> (ops, width, consts, output
    column); the KDA ops take reference's / interpret's `kda` states."""
    P, D = w.in_proj.shape
    H, d, r = w.H, w.d, w.f_b.shape[1]
    Hd = H * d
    proj = D
    f = proj + -(-P // BN) * BN
    g = f + Hd
    o = g + Hd
    resid2 = o + Hd
    ops = [Gemv("in_proj", w.in_proj, 0, proj, norm=w.in_norm),
           Gemv("f_b", w.f_b, proj + 3 * Hd, f), Gemv("g_b", w.g_b, proj + 3 * Hd + r, g),
           Kda("kda", proj, f, proj + 3 * Hd + 2 * r, g, o, w.conv_w, w.A_log, w.dt_bias, w.o_norm, w.lower_bound),
           Gemv("o_proj", w.o_proj, o, resid2, resid=0)]
    moe, width, consts, out = moe_block(w.post_norm, w.gate_w, w.bias, w.w13, w.w2, w.shared13, w.shared2, w.top_k,
                                        scaling, src=resid2)
    return ops + moe, width, consts, out


def layer_weights(make, c):
    """tasks.py's LayerWeights of a KDA layer at config c's widths, each tensor from make(*shape)."""
    D, H, d, E, I = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.num_experts, c.moe_intermediate_size
    Hd, Is = H * d, I * max(1, c.num_shared_experts)
    return LayerWeights(in_norm=make(D), in_proj=make(3 * Hd + 2 * d + H, D), f_b=make(Hd, d), g_b=make(Hd, d),
                        conv_w=make(3 * Hd, c.kda_conv_size).float(), A_log=make(H), dt_bias=make(Hd), o_norm=make(d),
                        o_proj=make(D, Hd), post_norm=make(D), gate_w=make(E, D), bias=make(E), w13=make(E, 2 * I, D),
                        w2=make(E, D, I), shared13=make(2 * Is, D), shared2=make(D, Is), H=H, d=d,
                        top_k=c.num_experts_per_token, lower_bound=c.kda_gate_lower_bound)


def case(name: str, make, model: str = "kimi-linear-48b-a3b"):
    """The op lists the persistent kernel (kernels/cute/persistent_layer.py) is built and measured for, at a model's
    widths: "dense" (a KDA layer's dense GEMVs as one chain, dense_chain), "moe" (its MoE block from the residual to
    the layer's output, moe_block) or "layer" (the whole KDA layer with its MoE block, kda_layer). make(*shape) gives
    a weight (a vector for a norm). -> (ops, width, consts, input columns, the KDA heads, d and conv taps or None)"""
    from ..config import resolve_model
    c, _ = resolve_model(model)
    D, E, I, k = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.num_experts_per_token
    Is = I * max(1, c.num_shared_experts)
    if name == "dense":
        ops, width = dense_chain(D, c.kda_num_heads * c.kda_head_dim, Is, make)
        return ops, width, {}, D, None
    if name == "moe":
        ops, width, consts, _ = moe_block(make(D), make(E, D), make(E), make(E, 2 * I, D), make(E, D, I),
                                          make(2 * Is, D), make(D, Is), k, c.routed_scaling_factor)
        return ops, width, consts, D, None
    if name == "layer":
        ops, width, consts, _ = kda_layer(layer_weights(make, c), c.routed_scaling_factor)
        return ops, width, consts, D, (c.kda_num_heads, c.kda_head_dim, c.kda_conv_size)
    raise ValueError(f"unknown case {name!r} (dense, moe, layer)")


def report(table: Table) -> dict:
    """The static schedule's load per CTA, in the weight bytes its producer streams if every expert assignment
    streamed its expert (the schedule's own assumption: routing is not known when the lists are fixed)."""
    fl = table.tasks.tolist()
    blocks = [sum((2 if fl[i][FLAGS] & GATED else 1) * fl[i][KBLK] for i in row if i >= 0)
              for row in table.lists.tolist()]
    mean = sum(blocks) / len(blocks)
    return {"B": table.B, "tasks": len(fl), "ctas": len(blocks), "max_tasks_per_cta": table.lists.shape[1],
            "weight_mb": sum(blocks) * BN * BK * 2 / 1e6, "busiest_cta_over_mean": max(blocks) / mean if mean else 0.0}


def main() -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser(description="The persistent kernel's task table for a 48B case (issue #46): task "
                                 "count and how evenly the static lists spread the weight bytes over the CTAs (the "
                                 "schedule's own byte counts, a design figure, not a timing)")
    ap.add_argument("--case", default="layer", choices=("dense", "moe", "layer"))
    ap.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated B")
    ap.add_argument("--ctas", type=int, default=132, help="CTAs, one per SM (H100 / H200: 132)")
    a = ap.parse_args()
    from . import table as tb  # the ops are the package module's classes, not this __main__'s
    ops, width, _, _, _ = tb.case(a.case, lambda *s: torch.empty(*s, device="meta"))
    for B in (int(x) for x in a.batch_sizes.split(",")):
        r = tb.report(tb.encode(ops, width, a.ctas, B))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)


if __name__ == "__main__":
    main()
