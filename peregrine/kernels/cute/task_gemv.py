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
  A wait that runs out writes task id + 1 to the error word (first one wins) and goes on, so nothing hangs.
- no queue, no atomics to claim work, nothing zeroed between steps: the epoch (a device int32 the caller adds 1 to
  before each launch, inside a CUDA graph if it likes) moves the counters' targets.

Its reference is persistent/table.py's `reference` (and `interpret` runs the same table on the CPU). Compiles for
sm_90a without a GPU (tests/test_cute_kernels.py); not run on a GPU yet, not used by the model. Known limits of
this first form: x is read from global memory (L1) per element, not staged in shared memory; one CTA per SM.
"""
from ...persistent.table import BK, BN, BLK0, COUNT0, COUNT1, DST, KBLK, SIGNAL, SRC, WAIT0, WAIT1

STAGES = 6                # ring depth: 6 x 16 KB blocks in flight per SM
PRODUCER_REGS, CONSUMER_REGS = 40, 232
THREADS = 256             # two warpgroups: producer, consumers
CONSUMER_BARRIER = 1      # named barrier among the 128 consumer threads (0 is __syncthreads)
MAX_POLLS = 1 << 20       # ~0.1-1 s of polling before a wait gives up and writes the error word
SLEEP_NS = 100            # between polls: leaves the memory system to the loads that matter


def build(B: int):
    """The kernel for B tokens and its host-side launcher (cute.jit); the DSL is an optional extra."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.nvgpu import cpasync

    def nanosleep():
        llvm.inline_asm(None, [], f"nanosleep.u32 {SLEEP_NS};", "", has_side_effects=True, asm_dialect=0)

    @cute.jit
    def wait(counters: cute.Tensor, err: cute.Tensor, ctr: cutlass.Int32, target: cutlass.Int32,
             task: cutlass.Int32):
        if ctr >= 0:
            ptr = (counters.iterator + ctr).llvm_ptr
            v = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
            polls = cutlass.Int32(0)
            while (v - target < 0) & (polls < MAX_POLLS):
                nanosleep()
                v = cute.arch.load(ptr, cutlass.Int32, sem="acquire", scope="gpu")
                polls += 1
            if v - target < 0:
                cute.arch.atomic_cas(err.iterator.llvm_ptr, cmp=cutlass.Int32(0), val=task + 1, sem="relaxed",
                                     scope="gpu")

    @cute.kernel
    def task_kernel(tma_atom: cute.CopyAtom, mPool: cute.Tensor, act: cute.Tensor, tasks: cute.Tensor,
                    lists: cute.Tensor, counters: cute.Tensor, epoch_t: cute.Tensor, err: cute.Tensor,
                    staged: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BN * BK * STAGES], 128]

        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sW = st.sW.get_tensor(staged)
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
                        b0 = tasks[t, BLK0]
                        for k in cutlass.range(tasks[t, KBLK], unroll=1):
                            pipe.producer_acquire(ps)
                            cute.copy(tma_atom, tWgW[(None, b0 + k, 0)], tWsW[(None, ps.index)],
                                      tma_bar_ptr=pipe.producer_get_barrier(ps))
                            pipe.producer_commit(ps)
                            ps.advance()
        else:  # warpgroup 1: the consumers, two threads a row
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            c = tidx - 128
            row, half = c // 2, c % 2
            epoch = epoch_t[0]
            cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            acc = cute.make_rmem_tensor((B,), cutlass.Float32)
            for n in cutlass.range(n_list, unroll=1):
                t = lists[bidx, n]
                if t >= 0:
                    src, dst = tasks[t, SRC], tasks[t, DST]
                    if c == 0:
                        wait(counters, err, tasks[t, WAIT0], epoch * tasks[t, COUNT0], t)
                        wait(counters, err, tasks[t, WAIT1], epoch * tasks[t, COUNT1], t)
                    cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
                    for b in cutlass.range_constexpr(B):
                        acc[b] = cutlass.Float32(0.0)
                    for k in cutlass.range(tasks[t, KBLK], unroll=1):
                        pipe.consumer_wait(cs)
                        base = src + k * BK + half * (BK // 2)
                        for j in cutlass.range_constexpr(BK // 2):
                            wv = sW[row, half * (BK // 2) + j, cs.index].to(cutlass.Float32)
                            for b in cutlass.range_constexpr(B):
                                acc[b] += wv * act[b, base + j]
                        pipe.consumer_release(cs)
                        cs.advance()
                    for b in cutlass.range_constexpr(B):
                        v = acc[b] + cute.arch.shuffle_sync_bfly(acc[b], offset=1)
                        if half == 0:
                            act[b, dst + row] = v
                    cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128)
                    if c == 0:
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.red((counters.iterator + tasks[t, SIGNAL]).llvm_ptr, cutlass.Int32(1), op="add",
                                      dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def launch(pool: cute.Tensor, act: cute.Tensor, tasks: cute.Tensor, lists: cute.Tensor, counters: cute.Tensor,
               epoch: cute.Tensor, err: cute.Tensor):
        one = cute.make_layout((BN, BK), stride=(BK, 1))
        staged = cute.make_layout((BN, BK, STAGES), stride=(BK, 1, BN * BK))
        tma_atom, tma_tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), pool, one, (BN, BK))
        task_kernel(tma_atom, tma_tensor, act, tasks, lists, counters, epoch, err, staged).launch(
            grid=(lists.shape[0], 1, 1), block=(THREADS, 1, 1))

    return launch


def fake_args(B: int, blocks: int, width: int, n_tasks: int, ctas: int, per_cta: int, n_counters: int):
    """Shape-only arguments for an ahead-of-time compile: the pool [blocks x BN, BK] BF16, act [B, width] FP32,
    tasks [n_tasks, FIELDS], lists [ctas, per_cta], counters [n_counters], epoch [1], err [1] int32."""
    import math

    import cutlass
    from cutlass.cute.runtime import make_fake_tensor
    from ...persistent.table import FIELDS

    def i32(*shape):  # row-major int32
        return make_fake_tensor(cutlass.Int32, shape, stride=tuple(math.prod(shape[k + 1:]) for k in range(len(shape))),
                                assumed_align=4)
    return (make_fake_tensor(cutlass.BFloat16, (blocks * BN, BK), stride=(BK, 1), assumed_align=16),
            make_fake_tensor(cutlass.Float32, (B, width), stride=(width, 1), assumed_align=16),
            i32(n_tasks, FIELDS), i32(ctas, per_cta), i32(n_counters), i32(1), i32(1))


def shape_args(table, B: int) -> dict:
    """fake_args' keywords for an encoded table (the compiled kernel is fixed to them)."""
    return {"B": B, "blocks": table.pool.shape[0] // BN, "width": table.width, "n_tasks": table.tasks.shape[0],
            "ctas": table.lists.shape[0], "per_cta": table.lists.shape[1], "n_counters": table.n_counters}


class Runner:
    """A built library (aot.build_shared over fake_args(**shape_args(table, B))) with its table on the GPU: step(act)
    adds 1 to the epoch and launches; the counters live across steps and are never zeroed; `error()` reads the
    error word (0, or the id + 1 of the first task whose wait ran out)."""

    def __init__(self, path: str, table, B: int, compiled: dict):
        import torch
        from .launch import CuteLibrary
        want = shape_args(table, B)
        if want != compiled:
            raise ValueError(f"{path} was compiled for {compiled}, this table needs {want}")
        dev = "cuda"
        self.lib = CuteLibrary(path)
        self.pool = table.pool.to(dev)
        self.tasks, self.lists = table.tasks.to(dev), table.lists.to(dev)
        self.counters = torch.zeros(table.n_counters, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)

    def step(self, act) -> None:
        self.epoch.add_(1)
        self.lib.run(self.pool, act, self.tasks, self.lists, self.counters, self.epoch, self.err)

    def error(self) -> int:
        return int(self.err.item())
