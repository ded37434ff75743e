"""CUDA graph capture after warm-up runs: the decode graphs (decode/standard.py's GraphCache, which the
specialized runner uses too) and the piecewise prefill graphs (decode/prefill_graphs.py) are made alike."""
from __future__ import annotations

import torch


def capture(fn, pool, warmups: int = 2):
    """fn() run `warmups` times on a side stream (allocator, cuBLAS workspaces, Triton compiles), then
    captured into a CUDA graph on `pool` -> (graph, what fn returned while captured)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out
