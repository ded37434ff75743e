"""CuTe kernels on the GPU (issue #46), from the libraries scripts/build_cute_gpu.sh builds on a CPU machine (.cute/,
carried to the device): the persistent task kernel over the 48B layer's dense GEMV chain, its MoE block (router,
top-k, routed experts, shared expert, combine) and the whole KDA layer equals the ops' FP32 reference (the router's
choice exactly, the KDA states too)
over two steps whose counters are never zeroed, and a wait that can never be met writes the error word and returns
instead of hanging. Skipped without a GPU or without the built library."""
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "moe", "layer"])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_task_gemv_equals_its_ops_and_trips_its_error_word(case, B):
    path = os.path.join(ROOT, ".cute", f"libtask_gemv-48b{case}-b{B}.so")
    if not torch.cuda.is_available() or not os.path.exists(path):
        pytest.skip("needs a GPU and .cute/ from scripts/build_cute_gpu.sh")
    from peregrine.bench.kernels_cute import TOL, task_gemv_case
    row = task_gemv_case(path, timed=False)
    assert "error" not in row, row
    assert row["rel_err"] < TOL and row["error_word"] == 0 and all(row.get("ids_equal", [True])), row
    assert row["missing_dep"]["error_word"] == row["missing_dep"]["want"], row
