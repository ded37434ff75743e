"""A chain of GEMVs encoded as the persistent kernel reads it: a weight pool of [BN, BK] blocks, a task table, a
fixed task list per CTA, and dependency counters (issue #46).

What the encoding commits to, and the CuTe kernel (kernels/cute/task_gemv.py) and `interpret` below both follow:
- weights: every op's W [N, K] cut into row tiles of BN, each tile's K in blocks of BK stored consecutively, so one
  TMA descriptor over the pool [blocks * BN, BK] streams any task's weights, whatever its matrix's shape;
- activations: one FP32 scratch [B, S]; op j reads columns [src, src + K) and writes [dst, dst + N); every column
  is written by at most one op (a step is single-assignment, so no write waits for a read);
- a task is one row tile of one op; it waits on the counter of each op that wrote what it reads until that counter
  reaches epoch x (that op's tile count), and adds one to its own op's counter when its rows are stored. Counters
  are never zeroed: step n waits for n x tiles, compared by wrapped difference, so they may overflow;
- per CTA, a task list fixed here (the emulator's list schedule by weight bytes), in an order consistent with one
  global order, so a CTA never waits on a task queued behind it and the lists cannot deadlock while all CTAs are
  resident. A wait that does not end within the kernel's bound writes task id + 1 to the error word.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .emulator import check_schedule, schedule
from .tasks import Region, Task, derive_deps

BN, BK = 64, 128     # a weight block: 64 rows x 128 values, 16 KB of BF16, one TMA copy
MAX_WAITS = 2        # producer ops a task may wait on (a GEMV reads one input; two covers a concatenated one)
# task table columns
BLK0, KBLK, SRC, DST, SIGNAL, WAIT0, COUNT0, WAIT1, COUNT1 = range(9)
FIELDS = 9


@dataclass
class Gemv:
    """y[:, dst:dst + N] = act[:, src:src + K] @ w.T"""
    name: str
    w: torch.Tensor      # [N, K], N a multiple of BN, K of BK
    src: int
    dst: int


@dataclass
class Table:
    pool: torch.Tensor      # [blocks * BN, BK] BF16
    tasks: torch.Tensor     # [T, FIELDS] int32
    lists: torch.Tensor     # [ctas, L] int32, -1 past each CTA's last task
    n_counters: int         # one per op
    width: int              # S: the activation scratch's columns
    tiles: list[int]        # row tiles per op (a counter's count per epoch)


def encode(ops: list[Gemv], width: int, ctas: int) -> Table:
    """The pool, task table and per-CTA lists for `ops` (in an order where each op's inputs are written by earlier
    ops or are the step's inputs) over an activation scratch of `width` columns."""
    written: list[tuple[int, int, int]] = []  # (lo, hi, op)
    blocks, rows, tiles = [], [], []
    for j, op in enumerate(ops):
        N, K = op.w.shape
        if N % BN or K % BK:
            raise ValueError(f"{op.name}: W is {N} x {K}; rows must be a multiple of {BN} and columns of {BK}")
        if op.src < 0 or op.src + K > width or op.dst < 0 or op.dst + N > width:
            raise ValueError(f"{op.name}: columns [{op.src}, {op.src + K}) or [{op.dst}, {op.dst + N}) outside the "
                             f"scratch's {width}")
        if op.src < op.dst + N and op.dst < op.src + K:
            raise ValueError(f"{op.name}: reads the columns it writes")
        if any(lo < op.dst + N and op.dst < hi for lo, hi, _ in written):
            raise ValueError(f"{op.name}: writes columns another op already wrote (a step is single-assignment)")
        written.append((op.dst, op.dst + N, j))
        tiles.append(N // BN)
    tasks: list[Task] = []
    fields: list[list[int]] = []
    nblk = 0
    for j, op in enumerate(ops):
        N, K = op.w.shape
        waits = sorted({i for lo, hi, i in written if i != j and lo < op.src + K and op.src < hi})
        if any(i > j for i in waits):
            raise ValueError(f"{op.name} reads what a later op writes: list the ops in the order they run")
        if len(waits) > MAX_WAITS:
            raise ValueError(f"{op.name} reads the outputs of {len(waits)} ops; a task waits on at most {MAX_WAITS}")
        wb = op.w.to(torch.bfloat16)
        for t in range(N // BN):
            tile = wb[t * BN:(t + 1) * BN]
            blocks += [tile[:, k * BK:(k + 1) * BK] for k in range(K // BK)]
            w_pad = waits + [-1] * (MAX_WAITS - len(waits))
            f = [nblk, K // BK, op.src, op.dst + t * BN, j]
            for i in w_pad:
                f += [i, tiles[i] if i >= 0 else 0]
            fields.append(f)
            nblk += K // BK
            # it waits for whole ops (one counter each), so the schedule must too, not only the tiles it reads
            reads = tuple(Region("act", ops[i].dst, ops[i].dst + ops[i].w.shape[0]) for i in waits)
            tasks.append(Task(f"{op.name}[{t}]", lambda s: None, reads,
                              (Region("act", op.dst + t * BN, op.dst + (t + 1) * BN),), tile.numel() * 2))
    derive_deps(tasks)
    lists, start = schedule(tasks, ctas)
    check_schedule(tasks, lists)
    L = max(1, max(len(x) for x in lists))
    lst = torch.full((ctas, L), -1, dtype=torch.int32)
    for c, x in enumerate(lists):
        x = sorted(x, key=lambda i: (start[i], i))
        lst[c, :len(x)] = torch.tensor(x, dtype=torch.int32)
    return Table(torch.cat(blocks), torch.tensor(fields, dtype=torch.int32), lst, len(ops), width, tiles)


def reference(ops: list[Gemv], act: torch.Tensor) -> torch.Tensor:
    """The chain in FP32, op after op, from BF16 weights (what the kernel streams): the scratch after the step."""
    act = act.clone()
    for op in ops:
        N, K = op.w.shape
        act[:, op.dst:op.dst + N] = act[:, op.src:op.src + K] @ op.w.to(torch.bfloat16).float().T
    return act


def interpret(tb: Table, act: torch.Tensor, counters: torch.Tensor, epoch: int,
              rng: random.Random | None = None) -> int:
    """Run the encoded table as the CTAs would, on the CPU: at each point one CTA whose next task's waits are met
    runs that task (drawn by rng, else the lowest CTA), reading its weights from the pool's blocks. Returns the
    error word: 0, or the id + 1 of a task still waiting when no CTA can go on (where the kernel's bounded wait
    would fire). `act` and `counters` (int64) are updated in place."""
    pc = [0] * tb.lists.shape[0]
    pool = tb.pool.float()

    def next_task(c):
        return int(tb.lists[c, pc[c]]) if pc[c] < tb.lists.shape[1] else -1

    def ready(t):
        f = tb.tasks[t].tolist()
        return all(f[w] < 0 or int(counters[f[w]]) - epoch * f[n] >= 0 for w, n in ((WAIT0, COUNT0), (WAIT1, COUNT1)))
    while True:
        live = [c for c in range(len(pc)) if next_task(c) >= 0]
        if not live:
            return 0
        go = [c for c in live if ready(next_task(c))]
        if not go:
            return min(next_task(c) for c in live) + 1
        c = rng.choice(go) if rng else go[0]
        t = next_task(c)
        b0, kb, src, dst, sig = tb.tasks[t, :SIGNAL + 1].tolist()
        w = torch.cat([pool[(b0 + k) * BN:(b0 + k + 1) * BN] for k in range(kb)], 1)  # [BN, kb * BK]
        act[:, dst:dst + BN] = act[:, src:src + kb * BK] @ w.T
        counters[sig] += 1
        pc[c] += 1


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
