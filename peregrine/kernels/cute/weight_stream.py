"""y = W x at one token, as a persistent layer's task streams its weights: warp-specialized, TMA into a ring.

The building block of issue #46's design: a producer warp streams W's tiles [BN, BK] with TMA bulk copies into a
STAGES-deep shared-memory ring, each stage guarded by a full / empty mbarrier pair (cutlass.pipeline's
PipelineTmaAsync), as early as the ring has room; the consumer warpgroup waits on a stage's barrier only, reduces
it against x and frees it. Warpgroup 0 holds the producer (its other warps idle, their registers given back with
setmaxnreg), warpgroup 1 the consumer (2 threads a row of the tile, their halves summed with one shuffle). CTAs take
the row tiles c, c + grid, ... (a static schedule, no queue). Shapes are static (one compile per W shape).

Compiles for sm_90a without a GPU (aot.py, tests/test_cute_kernels.py); not run on a GPU yet, not used by the model.
The FP32 reference is `reference` below.
"""

import torch

BN, BK, STAGES = 64, 128, 6   # rows a tile, values a K step (256 bytes of BF16 a row), ring depth
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # setmaxnreg per warpgroup: the producer needs few, the consumer the rest
THREADS = 256                 # two warpgroups: producer, consumer


def reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """FP32 y [N] = W [N, K] · x [K]."""
    return w.float() @ x.float()


def build():
    """The kernel and its host-side launcher (cute.jit), made on first use: the DSL is an optional extra."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass.cute.nvgpu import cpasync

    @cute.kernel
    def stream_kernel(tma_atom: cute.CopyAtom, mW: cute.Tensor, x: cute.Tensor, y: cute.Tensor,
                      staged: cute.Layout, n_tiles: cutlass.Int32, k_tiles: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, STAGES * 2]   # full and empty barrier per stage
            sW: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, BN * BK * STAGES], 128]

        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sW = st.sW.get_tensor(staged)
        pipe = pipeline.PipelineTmaAsync.create(
            num_stages=STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4), tx_count=BN * BK * 2,
            barrier_storage=st.bars.data_ptr(), cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        gW = cute.local_tile(mW, (BN, BK), (None, None))  # (BN, BK, n_tiles, k_tiles)
        tWsW, tWgW = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                           cute.group_modes(gW, 0, 2))
        if warp < 4:  # warpgroup 0: the producer
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                for t in cutlass.range(bidx, n_tiles, grid, unroll=1):
                    for k in cutlass.range(k_tiles, unroll=1):
                        pipe.producer_acquire(ps)  # an empty stage, its full barrier armed for the bytes
                        cute.copy(tma_atom, tWgW[(None, t, k)], tWsW[(None, ps.index)],
                                  tma_bar_ptr=pipe.producer_get_barrier(ps))
                        pipe.producer_commit(ps)
                        ps.advance()
        else:  # warpgroup 1: the consumer, two threads a row
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            c = tidx - 128
            row, half = c // 2, c % 2
            cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for t in cutlass.range(bidx, n_tiles, grid, unroll=1):
                acc = cutlass.Float32(0.0)
                for k in cutlass.range(k_tiles, unroll=1):
                    pipe.consumer_wait(cs)
                    for j in cutlass.range_constexpr(BK // 2):
                        kk = half * (BK // 2) + j
                        acc += sW[row, kk, cs.index].to(cutlass.Float32) * x[k * BK + kk].to(cutlass.Float32)
                    pipe.consumer_release(cs)
                    cs.advance()
                acc += cute.arch.shuffle_sync_bfly(acc, offset=1)
                if half == 0:
                    y[t * BN + row] = acc

    @cute.jit
    def stream(w: cute.Tensor, x: cute.Tensor, y: cute.Tensor, num_sms: cutlass.Constexpr):
        one = cute.make_layout((BN, BK), stride=(BK, 1))
        staged = cute.make_layout((BN, BK, STAGES), stride=(BK, 1, BN * BK))
        tma_atom, tma_tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), w, one, (BN, BK))
        stream_kernel(tma_atom, tma_tensor, x, y, staged, w.shape[0] // BN, w.shape[1] // BK).launch(
            grid=(num_sms, 1, 1), block=(THREADS, 1, 1))

    return stream


def fake_args(N: int, K: int):
    """Shape-only arguments for an ahead-of-time compile (no GPU, no memory): W [N, K] BF16, x [K] BF16, y [N]
    FP32; N a multiple of BN, K of BK."""
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor
    assert N % BN == 0 and K % BK == 0, (N, K)
    return (make_fake_tensor(cutlass.BFloat16, (N, K), stride=(K, 1), assumed_align=16),
            make_fake_tensor(cutlass.BFloat16, (K,), stride=(1,), assumed_align=16),
            make_fake_tensor(cutlass.Float32, (N,), stride=(1,), assumed_align=16))
