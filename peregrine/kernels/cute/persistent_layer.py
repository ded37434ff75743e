"""A persistent kernel over a static task list of GEMV tiles: issue #46's schedule, counters and bounded waits.

It runs persistent/table.py's encoding (the weight pool of [BN, BK] blocks, the task table, one list per CTA, one
counter per op) for B tokens:
- warpgroup 0, one producer warp: walks its CTA's list and streams each task's weight blocks with TMA into a
  STAGES-deep ring (full / empty mbarrier pairs), as far ahead as the ring allows and before the task's inputs
  exist: weights never depend on the step, so a task's loads overlap the tasks it waits for;
- warpgroup 1, the consumers (two threads a row of the tile): per task, one thread polls the counters of the ops it
  reads (ld.acquire.gpu, wrapped difference against epoch x tiles, nanosleep between polls, at most MAX_POLLS);
  a bar.sync among the 128 lets the others read the inputs; each stage is reduced against x for the B tokens and
  freed; the rows are stored, a second bar.sync, and one thread adds 1 to the op's counter (fence, red.release.gpu).
  A wait that runs out writes task id + 1 to the error word (first one wins; with the counter, its target and the
  value seen) and goes on, and every wait after it gives up at once, so nothing hangs: a deadlock ends in one
  MAX_POLLS with what it waited for.
- no queue, no atomics to claim work, nothing zeroed between steps: the epoch (a device int32 the caller adds 1 to
  before each launch, inside a CUDA graph if it likes) moves the counters' targets.

Its reference is persistent/table.py's `reference` (and `interpret` runs the same table on the CPU). Compiles for
sm_90a without a GPU (tests/test_cute_kernels.py); not run on a GPU yet, not used by the model. Known limits of
this first form: x is read from global memory (L1) per element, not staged in shared memory; one CTA per SM.
"""
from ...persistent.table import (BCOL, BK, BLK0, BN, BOUNDED, COUNT0, COUNT1, COUNT2, DST, EPS, EPS_QK, ESTRIDE, EXPERT,
                                 EXTRA, FCOL, FLAGS, GATED, GEMV, HEAD, IDS, KBLK, KDA, KIND, N_OUT, NORM, PARAM,
                                 PCOUNT, PER_SLOT, PWAIT, RCOL, RESID, SIGNAL, SLOT, SRC, TOKEN, TOPK, TOPK_K, WAIT0,
                                 WAIT1, WAIT2, WEIGHTED)

STAGES = 6                # ring depth: 6 x 16 KB blocks in flight per SM
PRODUCER_REGS, CONSUMER_REGS = 40, 232
THREADS = 256             # two warpgroups: producer, consumers
CONSUMER_BARRIER = 1      # named barrier among the 128 consumer threads (0 is __syncthreads)
MAX_POLLS = 1 << 20       # ~0.1-1 s of polling before a wait gives up and writes the error word
ERR_FIELDS = 4            # error record: first failed task + 1, the counter it waited on, its target, the value seen
SLEEP_NS = 100            # between polls: leaves the memory system to the loads that matter
UNROLL = 8                # a block's K loop unrolled this far
HEAD_DIM = 128            # a KDA head's width: one consumer thread a channel and a column of its state


def build(B: int, max_experts: int = 256, conv: int = 4):
    """The kernel for B tokens (routers of at most max_experts experts, KDA heads of HEAD_DIM with a short
    convolution of `conv` taps) and its host-side launcher (cute.jit); the DSL is an optional extra."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.nvgpu import cpasync

    EPT = -(-max_experts // 128)  # router scores each consumer thread holds
    NEG = -3.0e38                 # below every score: a taken or absent expert

    def nanosleep():
        llvm.inline_asm(None, [], f"nanosleep.u32 {SLEEP_NS};", "", has_side_effects=True, asm_dialect=0)

    @cute.jit
    def wait(counters: cute.Tensor, err: cute.Tensor, ctr: Int32, target: Int32, task: Int32):
        if ctr >= 0:
            ptr = (counters.iterator + ctr).llvm_ptr
            eptr = err.iterator.llvm_ptr
            v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
            failed = cute.arch.load(eptr, Int32, sem="relaxed", scope="gpu")
            polls = Int32(0)
            # once any wait has run out, every other gives up at once: a deadlock costs one MAX_POLLS, not one a task
            while (v - target < 0) & (polls < MAX_POLLS) & (failed == 0):
                nanosleep()
                v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
                failed = cute.arch.load(eptr, Int32, sem="relaxed", scope="gpu")
                polls += 1
            if v - target < 0:
                first = cute.arch.atomic_cas(eptr, cmp=Int32(0), val=task + 1, sem="relaxed", scope="gpu")
                if first == 0:  # the first failed wait: what it waited for
                    err[1] = ctr
                    err[2] = target
                    err[3] = v

    @cute.jit
    def consumer_sum(v: Float32, red: cute.Tensor, slot: cutlass.Constexpr, c: Int32) -> Float32:
        """The sum of v over the 128 consumer threads (shuffles, then the 4 warps through shared memory)."""
        for off in cutlass.range_constexpr(5):
            v += cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
        if c % 32 == 0:
            red[slot * 4 + c // 32] = v
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
        return red[slot * 4] + red[slot * 4 + 1] + red[slot * 4 + 2] + red[slot * 4 + 3]

    @cute.jit
    def add_block(acc: cute.Tensor, act: cute.Tensor, sW: cute.Tensor, stage: Int32, x0: Int32, xoff: cute.Tensor,
                  row: Int32, half: Int32):
        """acc[b] += this thread's half of a ring stage's row `row` . act[b, x0 + xoff[b]:... + BK] for the B tokens
        (the pipeline is waited on and released by the caller: its state must stay in the kernel's own loops)."""
        base = x0 + half * (BK // 2)
        for j in cutlass.range(BK // 2, unroll=UNROLL):  # unrolled whole, B = 8 spilled its hoisted loads
            wv = sW[row, half * (BK // 2) + j, stage].to(Float32)
            for r in cutlass.range_constexpr(B):
                acc[r] += wv * act[r, base + xoff[r] + j]

    @cute.jit
    def first_use(act: cute.Tensor, tasks: cute.Tensor, t: Int32) -> Int32:
        """1 if this (token, slot) is its expert's first in the flat ids (it serves every token that chose the
        expert), else 0 (the task streams and computes nothing)."""
        k, ids, j = tasks[t, TOPK_K], tasks[t, IDS], tasks[t, TOKEN] * tasks[t, TOPK_K] + tasks[t, SLOT]
        e = act[tasks[t, TOKEN], ids + tasks[t, SLOT]]
        first = Int32(1)
        for i in cutlass.range(j, unroll=1):
            if act[i // k, ids + i % k] == e:
                first = Int32(0)
        return first

    @cute.jit
    def norm_scale(act: cute.Tensor, red: cute.Tensor, scale: cute.Tensor, src: Int32, K: Int32, norm: Int32,
                   c: Int32):
        """scale[b] = 1 / rms of token b's input (RMSNorm; its weight is in the columns), or 1."""
        for r in cutlass.range_constexpr(B):
            scale[r] = Float32(1.0)
        if norm != 0:
            for r in cutlass.range_constexpr(B):
                ss = Float32(0.0)
                for i in cutlass.range(c, K, 128, unroll=1):
                    x = act[r, src + i]
                    ss += x * x
                scale[r] = cute.math.rsqrt(consumer_sum(ss, red, r % 2, c) / K.to(Float32) + EPS)

    @cute.jit
    def gemv_out(act: cute.Tensor, tasks: cute.Tensor, t: Int32, c: Int32, accg: cute.Tensor, accu: cute.Tensor,
                 scale: cute.Tensor, slot: cute.Tensor):
        """A GEMV or routed-expert tile's epilogue, per token: the two threads of a row summed, SwiGLU, the residual
        (GEMV) or the slot's weight, stored at the token's slot (experts: slot[b] < 0, the token did not choose it)."""
        row, half = c // 2, c % 2
        flags, kind = tasks[t, FLAGS], tasks[t, KIND]
        for r in cutlass.range_constexpr(B):
            y = (accg[r] + cute.arch.shuffle_sync_bfly(accg[r], offset=1)) * scale[r]
            u = (accu[r] + cute.arch.shuffle_sync_bfly(accu[r], offset=1)) * scale[r]
            if flags & GATED:
                y = y / (Float32(1.0) + cute.math.exp(-y)) * u
            if kind == GEMV:
                if tasks[t, RESID] >= 0:
                    y += act[r, tasks[t, RESID] + row]
                if half == 0:
                    act[r, tasks[t, DST] + row] = y
            elif slot[r] >= 0:
                if flags & WEIGHTED:
                    y *= act[r, tasks[t, IDS] + tasks[t, TOPK_K] + slot[r]]
                if half == 0:
                    act[r, tasks[t, DST] + slot[r] * tasks[t, N_OUT] + row] = y

    @cute.jit
    def topk_task(act: cute.Tensor, red: cute.Tensor, tasks: cute.Tensor, t: Int32, c: Int32, ch: cute.Tensor,
                  sc: cute.Tensor):
        """Per token: top-k of sigmoid + bias, expert c + 128 i held by consumer c; k rounds of a 128-thread argmax
        (ties to the lower expert) whose winner's owner writes its id and score; then one thread renormalizes the
        k scores and applies the scaling factor (the constant after the bias)."""
        src, dst, bias, E, k = tasks[t, SRC], tasks[t, DST], tasks[t, RESID], tasks[t, N_OUT], tasks[t, TOPK_K]
        for b in cutlass.range_constexpr(B):
            for i in cutlass.range_constexpr(EPT):
                ch[i], sc[i] = Float32(NEG), Float32(0.0)
                e = c + 128 * i
                if e < E:
                    sc[i] = Float32(1.0) / (Float32(1.0) + cute.math.exp(-act[b, src + e]))
                    ch[i] = sc[i] + act[b, bias + e]
            for r in cutlass.range(k, unroll=1):
                best, bi = Float32(NEG), Int32(1 << 30)
                for i in cutlass.range_constexpr(EPT):
                    if ch[i] > best:  # i rises with the expert id: strict > keeps the lower one on a tie
                        best, bi = ch[i], c + 128 * i
                for off in cutlass.range_constexpr(5):
                    ob = cute.arch.shuffle_sync_bfly(best, offset=16 >> off)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> off)
                    if (ob > best) | ((ob == best) & (oi < bi)):
                        best, bi = ob, oi
                if c % 32 == 0:
                    red[c // 32] = best
                    red[4 + c // 32] = bi.to(Float32)
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
                wb, wi = red[0], red[4]
                for w in cutlass.range_constexpr(1, 4):
                    if (red[w] > wb) | ((red[w] == wb) & (red[4 + w] < wi)):
                        wb, wi = red[w], red[4 + w]
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
                for i in cutlass.range_constexpr(EPT):
                    if c + 128 * i == wi.to(Int32):
                        act[b, dst + r] = wi
                        act[b, dst + k + r] = sc[i]
                        ch[i] = Float32(NEG)
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
            if c == 0:
                total = Float32(0.0)
                for r in cutlass.range(k, unroll=1):
                    total += act[b, dst + k + r]
                f = act[b, bias + E] / total
                for r in cutlass.range(k, unroll=1):
                    act[b, dst + k + r] = act[b, dst + k + r] * f

    @cute.jit
    def kda_task(act: cute.Tensor, red: cute.Tensor, skv: cute.Tensor, tasks: cute.Tensor, t: Int32, c: Int32,
                 params: cute.Tensor, state: cute.Tensor, conv_state: cute.Tensor, slots: cute.Tensor,
                 qkv: cute.Tensor, hist: cute.Tensor):
        """One KDA head for each token (kernels/kda.py's decode, T = 1): consumer c owns channel c of q, k and v
        (their convolution, SiLU, L2 norms) and column c of the head's state [d, d] (read twice: decayed . k for the
        delta rule, then decayed plus k u, stored, . q), then the output's gated RMSNorm."""
        h, Hd, p0, src = tasks[t, HEAD], tasks[t, N_OUT], tasks[t, PARAM], tasks[t, SRC]
        H = Hd // HEAD_DIM
        alog, dtb = p0 + 3 * Hd * conv, p0 + 3 * Hd * conv + H
        onorm = dtb + Hd
        a = cute.math.exp(params[alog + h])
        for b in cutlass.range_constexpr(B):
            s = slots[b]
            for which in cutlass.range_constexpr(3):  # q, k, v: the causal convolution over the raw inputs, SiLU
                ch = which * Hd + h * HEAD_DIM + c
                for w in cutlass.range_constexpr(conv - 1):
                    hist[w] = conv_state[s, w, ch]
                x = act[b, src + ch]
                y = params[p0 + ch * conv + conv - 1] * x
                for w in cutlass.range_constexpr(conv - 1):
                    y += params[p0 + ch * conv + w] * hist[w]
                for w in cutlass.range_constexpr(conv - 2):
                    conv_state[s, w, ch] = hist[w + 1]
                conv_state[s, conv - 2, ch] = x
                qkv[which] = y / (Float32(1.0) + cute.math.exp(-y))
            q = qkv[0] * cute.math.rsqrt(consumer_sum(qkv[0] * qkv[0], red, 0, c) + EPS_QK) * (HEAD_DIM ** -0.5)
            k = qkv[1] * cute.math.rsqrt(consumer_sum(qkv[1] * qkv[1], red, 1, c) + EPS_QK)
            g = act[b, tasks[t, FCOL] + h * HEAD_DIM + c] + params[dtb + h * HEAD_DIM + c]
            gam = Float32(0.0)
            if tasks[t, FLAGS] & BOUNDED:
                gam = params[onorm + HEAD_DIM] / (Float32(1.0) + cute.math.exp(-a * g))
            else:  # -a softplus(g), softplus overflow-safe
                sp = g
                if g < Float32(20.0):
                    sp = cute.math.log1p(cute.math.exp(g))
                gam = -a * sp
            skv[c], skv[HEAD_DIM + c], skv[2 * HEAD_DIM + c] = q, k, cute.math.exp(gam)
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
            beta = Float32(1.0) / (Float32(1.0) + cute.math.exp(-act[b, tasks[t, BCOL] + h]))
            kv = Float32(0.0)
            for i in cutlass.range(HEAD_DIM, unroll=UNROLL):  # column c of S, decayed by its rows' gates, . k
                kv += state[s, h, i, c] * skv[2 * HEAD_DIM + i] * skv[HEAD_DIM + i]
            u = beta * (qkv[2] - kv)
            o = Float32(0.0)
            for i in cutlass.range(HEAD_DIM, unroll=UNROLL):  # read again (L1): held in registers, it spilled
                v = state[s, h, i, c] * skv[2 * HEAD_DIM + i] + skv[HEAD_DIM + i] * u
                o += v * skv[i]
                state[s, h, i, c] = v
            rms = cute.math.rsqrt(consumer_sum(o * o, red, 0, c) / Float32(HEAD_DIM) + EPS)
            r = act[b, tasks[t, RCOL] + h * HEAD_DIM + c]
            act[b, tasks[t, DST] + c] = o * rms * params[onorm + c] / (Float32(1.0) + cute.math.exp(-r))
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)  # skv is the next token's

    @cute.jit
    def combine_task(act: cute.Tensor, tasks: cute.Tensor, t: Int32, c: Int32):
        """out = resid + extra + sum over the k routed parts, one row of the tile a thread (64 of 128)."""
        if c < BN:
            src, n, k = tasks[t, SRC], tasks[t, N_OUT], tasks[t, TOPK_K]
            for b in cutlass.range_constexpr(B):
                y = act[b, tasks[t, RESID] + c] + act[b, tasks[t, EXTRA] + c]
                for s in cutlass.range(k, unroll=1):
                    y += act[b, src + s * n + c]
                act[b, tasks[t, DST] + c] = y

    @cute.kernel
    def task_kernel(tma_atom: cute.CopyAtom, mPool: cute.Tensor, act: cute.Tensor, tasks: cute.Tensor,
                    lists: cute.Tensor, counters: cute.Tensor, epoch_t: cute.Tensor, err: cute.Tensor,
                    params: cute.Tensor, state: cute.Tensor, conv_state: cute.Tensor, slots: cute.Tensor,
                    staged: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            red: cute.struct.MemRange[Float32, 8]   # cross-warp sums and the router's argmax
            skv: cute.struct.MemRange[Float32, 3 * HEAD_DIM]  # a KDA head's normalized q, k and row decays
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BN * BK * STAGES], 128]

        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sW = st.sW.get_tensor(staged)
        red = st.red.get_tensor(cute.make_layout(8))
        skv = st.skv.get_tensor(cute.make_layout(3 * HEAD_DIM))
        pipe = pipeline.PipelineTmaAsync.create(
            num_stages=STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4), tx_count=BN * BK * 2,
            barrier_storage=st.bars.data_ptr(), cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        gW = cute.local_tile(mPool, (BN, BK), (None, None))  # (BN, BK, blocks, 1)
        tWsW, tWgW = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                           cute.group_modes(gW, 0, 2))
        n_list = lists.shape[1]
        if warp < 4:  # warpgroup 0: the producer
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                for n in cutlass.range(n_list, unroll=1):
                    t = lists[bidx, n]
                    if t >= 0:
                        kind = tasks[t, KIND]
                        if (kind == GEMV) | (kind == EXPERT):
                            b0 = tasks[t, BLK0]
                            nb = tasks[t, KBLK]
                            if tasks[t, FLAGS] & GATED:
                                nb = nb * 2
                            if kind == EXPERT:  # its weights follow the router: the one wait a producer makes
                                wait(counters, err, tasks[t, PWAIT], epoch_t[0] * tasks[t, PCOUNT], t)
                                e = act[tasks[t, TOKEN], tasks[t, IDS] + tasks[t, SLOT]].to(Int32)
                                b0 += e * tasks[t, ESTRIDE]
                                nb = nb * first_use(act, tasks, t)
                            for k in cutlass.range(nb, unroll=1):
                                pipe.producer_acquire(ps)
                                cute.copy(tma_atom, tWgW[(None, b0 + k, 0)], tWsW[(None, ps.index)],
                                          tma_bar_ptr=pipe.producer_get_barrier(ps))
                                pipe.producer_commit(ps)
                                ps.advance()
        else:  # warpgroup 1: the consumers
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            c = tidx - 128
            epoch = epoch_t[0]
            cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            accg = cute.make_rmem_tensor((B,), Float32)
            accu = cute.make_rmem_tensor((B,), Float32)
            scale = cute.make_rmem_tensor((B,), Float32)
            ch = cute.make_rmem_tensor((EPT,), Float32)
            sc = cute.make_rmem_tensor((EPT,), Float32)
            qkv = cute.make_rmem_tensor((3,), Float32)
            hist = cute.make_rmem_tensor((conv,), Float32)
            slot = cute.make_rmem_tensor((B,), Int32)
            xoff = cute.make_rmem_tensor((B,), Int32)
            for n in cutlass.range(n_list, unroll=1):
                t = lists[bidx, n]
                if t >= 0:
                    kind = tasks[t, KIND]
                    if c == 0:
                        wait(counters, err, tasks[t, WAIT0], epoch * tasks[t, COUNT0], t)
                        wait(counters, err, tasks[t, WAIT1], epoch * tasks[t, COUNT1], t)
                        wait(counters, err, tasks[t, WAIT2], epoch * tasks[t, COUNT2], t)
                        cute.arch.fence_acq_rel_gpu()  # as a grid barrier does: the others read after bar.sync
                    cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
                    if (kind == GEMV) | (kind == EXPERT):
                        src, kb = tasks[t, SRC], tasks[t, KBLK]
                        go = Int32(1)
                        for r in cutlass.range_constexpr(B):
                            slot[r], xoff[r] = Int32(0), Int32(0)
                        if kind == EXPERT:  # which tokens chose this expert, at which slot (-1: none)
                            go = first_use(act, tasks, t)
                            e = act[tasks[t, TOKEN], tasks[t, IDS] + tasks[t, SLOT]]
                            for r in cutlass.range_constexpr(B):
                                slot[r] = Int32(-1)
                                for j in cutlass.range(tasks[t, TOPK_K], unroll=1):
                                    if act[r, tasks[t, IDS] + j] == e:
                                        slot[r] = j
                                if tasks[t, FLAGS] & PER_SLOT:
                                    if slot[r] >= 0:
                                        xoff[r] = slot[r] * kb * BK
                        if go != 0:
                            norm_scale(act, red, scale, src, kb * BK, tasks[t, FLAGS] & NORM, c)
                            for r in cutlass.range_constexpr(B):
                                accg[r], accu[r] = Float32(0.0), Float32(0.0)
                            nb = kb
                            if tasks[t, FLAGS] & GATED:
                                nb = kb * 2
                            for k in cutlass.range(nb, unroll=1):  # gate blocks into accg, then up blocks into accu
                                pipe.consumer_wait(cs)
                                x0 = src + (k % kb) * BK
                                if k < kb:
                                    add_block(accg, act, sW, cs.index, x0, xoff, c // 2, c % 2)
                                else:
                                    add_block(accu, act, sW, cs.index, x0, xoff, c // 2, c % 2)
                                pipe.consumer_release(cs)
                                cs.advance()
                            gemv_out(act, tasks, t, c, accg, accu, scale, slot)
                    elif kind == KDA:
                        kda_task(act, red, skv, tasks, t, c, params, state, conv_state, slots, qkv, hist)
                    elif kind == TOPK:
                        topk_task(act, red, tasks, t, c, ch, sc)
                    else:
                        combine_task(act, tasks, t, c)
                    cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
                    if c == 0:
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.red((counters.iterator + tasks[t, SIGNAL]).llvm_ptr, Int32(1), op="add",
                                      dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def launch(pool: cute.Tensor, act: cute.Tensor, tasks: cute.Tensor, lists: cute.Tensor, counters: cute.Tensor,
               epoch: cute.Tensor, err: cute.Tensor, params: cute.Tensor, state: cute.Tensor, conv_state: cute.Tensor,
               slots: cute.Tensor):
        one = cute.make_layout((BN, BK), stride=(BK, 1))
        staged = cute.make_layout((BN, BK, STAGES), stride=(BK, 1, BN * BK))
        tma_atom, tma_tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), pool, one, (BN, BK))
        task_kernel(tma_atom, tma_tensor, act, tasks, lists, counters, epoch, err, params, state, conv_state, slots,
                    staged).launch(
            grid=(lists.shape[0], 1, 1), block=(THREADS, 1, 1))

    return launch


def fake_args(B: int, blocks: int, width: int, n_tasks: int, ctas: int, per_cta: int, n_counters: int,
              n_params: int = 1, kda_slots: int = 1, kda_heads: int = 1, conv: int = 4, channels: int = 3 * 128):
    """Shape-only arguments for an ahead-of-time compile: the pool [blocks x BN, BK] BF16, act [B, width] FP32,
    tasks [n_tasks, FIELDS], lists [ctas, per_cta], counters [n_counters], epoch [1], err [ERR_FIELDS] int32, params
    [n_params] FP32, the KDA state [kda_slots, kda_heads, HEAD_DIM, HEAD_DIM] and conv state [kda_slots, conv - 1,
    channels] FP32, slots [B] int32 (a table without KDA tasks takes the smallest)."""
    import math

    import cutlass
    from cutlass.cute.runtime import make_fake_tensor
    from ...persistent.table import FIELDS

    def t(dtype, *shape, align=4):  # row-major
        return make_fake_tensor(dtype, shape, stride=tuple(math.prod(shape[k + 1:]) for k in range(len(shape))),
                                assumed_align=align)
    i32, f32 = cutlass.Int32, cutlass.Float32
    return (t(cutlass.BFloat16, blocks * BN, BK, align=16), t(f32, B, width, align=16), t(i32, n_tasks, FIELDS),
            t(i32, ctas, per_cta), t(i32, n_counters), t(i32, 1), t(i32, ERR_FIELDS), t(f32, n_params),
            t(f32, kda_slots, kda_heads, HEAD_DIM, HEAD_DIM), t(f32, kda_slots, conv - 1, channels), t(i32, B))


N_TENSORS = 11  # fake_args' tensors: the built library's cute_run takes as many pointers


def shape_args(table, B: int, kda=None, kda_slots: int = 1) -> dict:
    """fake_args' keywords for an encoded table (the compiled kernel is fixed to them); kda: (heads, d, conv taps)
    of its KDA op, with kda_slots state slots."""
    a = {"B": B, "blocks": table.pool.shape[0] // BN, "width": table.width, "n_tasks": table.tasks.shape[0],
         "ctas": table.lists.shape[0], "per_cta": table.lists.shape[1], "n_counters": table.n_counters,
         "n_params": table.params.numel()}
    if kda is not None:
        H, d, W = kda
        if d != HEAD_DIM:
            raise ValueError(f"KDA heads of {d}: the kernel's are {HEAD_DIM} (one consumer thread a channel)")
        a.update(kda_slots=kda_slots, kda_heads=H, conv=W, channels=3 * H * d)
    return a


class Runner:
    """A built library (aot.build_shared over fake_args(**shape_args(...))) with its table on the GPU: step(act)
    adds 1 to the epoch and launches; the counters live across steps and are never zeroed; `error()` reads the
    error word (0, or the id + 1 of the first task whose wait ran out), `error_detail()` what it waited for. kda:
    the state, conv_state and slots
    tensors of a table with KDA tasks (else placeholders of the compiled shapes)."""

    def __init__(self, path: str, table, B: int, compiled: dict, kda: dict | None = None):
        import torch
        from .launch import CuteLibrary
        shapes = {k: v for k, v in compiled.items() if k in ("kda_slots", "kda_heads", "conv", "channels")}
        kda_shape = None if "kda_heads" not in shapes else (shapes["kda_heads"], HEAD_DIM, shapes["conv"])
        want = shape_args(table, B, kda_shape, shapes.get("kda_slots", 1))
        if want != compiled:
            raise ValueError(f"{path} was compiled for {compiled}, this table needs {want}")
        dev = "cuda"
        self.lib, self.path, self.launches = CuteLibrary(path), path, 0
        self.pool, self.params = table.pool.to(dev), table.params.to(dev, torch.float32)
        self.tasks, self.lists = table.tasks.to(dev), table.lists.to(dev)
        self.counters = torch.zeros(table.n_counters, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(ERR_FIELDS, dtype=torch.int32, device=dev)
        self.table = table
        if kda is None:
            S, H, W, C = (compiled.get(k, v) for k, v in (("kda_slots", 1), ("kda_heads", 1), ("conv", 4),
                                                           ("channels", 3 * HEAD_DIM)))
            kda = {"state": torch.zeros(S, H, HEAD_DIM, HEAD_DIM, device=dev),
                   "conv_state": torch.zeros(S, W - 1, C, device=dev),
                   "slots": torch.zeros(B, dtype=torch.int32, device=dev)}
        self.kda = kda

    def step(self, act, watchdog_s: float | None = None) -> None:
        """One launch. watchdog_s: wait for it that long at most, then end the process (exit 124), naming the
        library and the launch: a hang the bounded waits cannot end (an mbarrier of the weight ring) must not cost
        the device call its whole limit, and a hung kernel cannot be interrupted any other way."""
        self.epoch.add_(1)
        self.launches += 1  # counted on the host: a hung kernel's device memory cannot be read
        k = self.kda
        self.lib.run(self.pool, act, self.tasks, self.lists, self.counters, self.epoch, self.err, self.params,
                     k["state"], k["conv_state"], k["slots"])
        if watchdog_s is not None:
            import os
            import sys
            import time

            import torch
            done, t0 = torch.cuda.Event(), time.monotonic()
            done.record()
            while not done.query():
                if time.monotonic() - t0 > watchdog_s:
                    sys.stderr.write(f"persistent kernel {self.path}: launch {self.launches} not done after "
                                     f"{watchdog_s:.0f} s: hung (the weight ring's mbarriers are not bounded); "
                                     f"ending the process\n")
                    sys.stderr.flush()
                    os._exit(124)
                time.sleep(0.001)

    def error(self) -> int:
        return int(self.err[0].item())

    def error_detail(self) -> dict | None:
        """The first failed wait: its task, the op it computes, the counter (the op it waited for), the target and
        the value it saw (targets are epoch x tasks of that op); None without one."""
        e = [int(v) for v in self.err.tolist()]
        if not e[0]:
            return None
        task = e[0] - 1
        return {"task": task, "op": int(self.table.tasks[task, SIGNAL]), "waited_on_op": e[1], "target": e[2],
                "seen": e[3], "epoch": int(self.epoch.item())}
