"""Every environment variable peregrine reads, in one place: its values, its default and what it does.

docs/configuration.md is rendered from these tables (python -m peregrine.reference). tests/test_docs.py holds them
to the code: every PEREGRINE_* name in peregrine/ has an entry here, and every entry's file reads it. The modules
keep their own constants (host_memory.TRIM_ENV and the like); this file only describes them.
"""
from __future__ import annotations

from typing import NamedTuple


class Var(NamedTuple):
    values: str     # what it may be set to
    default: str    # what happens when it is unset
    help: str       # what it does, in plain sentences
    read_in: str    # the file that reads it, from the repository root


# switches a user or an operator may set
SWITCHES = {
    "PEREGRINE_MALLOC_TRIM_S": Var(
        "seconds (a number >= 0)", "1",
        "Seconds between the engine's trims of the host allocator (glibc malloc_trim) under load. "
        "0 turns the trims off.",
        "peregrine/host_memory.py"),
    "PEREGRINE_LOG_COMPILES": Var(
        "1", "off",
        "`peregrine serve` counts the Triton compiles of its start-up. After that it logs each later compile "
        "as a warning, with the kernel and its specialization: a kernel the warm-up missed.",
        "peregrine/compile_log.py"),
    "PEREGRINE_MLA_CUDNN": Var(
        "0", "on where it applies",
        "0 sends cold MLA prefill rows of 16 384 tokens or more through the Triton kernel instead of cuDNN.",
        "peregrine/kernels/mla_prefill_sdpa.py"),
    "PEREGRINE_SPEC_WIDTH": Var(
        "auto, full", "auto",
        "Speculative decoding. auto verifies only the drafts that the measured step costs say will pay. "
        "full verifies every draft.",
        "peregrine/speculative/decoder.py"),
    "PEREGRINE_MXFP4": Var(
        "v3, v4", "v4 on Hopper, v3 elsewhere",
        "The MXFP4 expert kernels of the latency_specialized path. v4 repacks the experts in place at start. "
        "v3 keeps the checkpoint's layout.",
        "peregrine/decode/specialized.py"),
    "PEREGRINE_MXFP4_GROUPED": Var(
        "0, 1", "the grouped kernel where the kernels run on a GPU",
        "MXFP4 experts outside decode. 0 uses the dequantize loop instead of the grouped kernel: it syncs, and "
        "prefill graphs turn off. 1 forces the grouped kernel.",
        "peregrine/models/moe.py"),
    "PEREGRINE_GEMM_PLAN": Var(
        "a file path", "peregrine/kernels/gemm_plan.json",
        "Another skinny-GEMM plan file, for example a freshly tuned one, without replacing the shipped plan.",
        "peregrine/kernels/gemm.py"),
    "PEREGRINE_COMMIT": Var(
        "a commit id", "git HEAD, else .commit",
        "The commit that benchmark results record. The device scripts set it from .commit, because the "
        "device copy's git metadata can be stale.",
        "peregrine/bench/gpu.py"),
}

# A/B switches kept only until a queued GPU measurement decides them (scripts/gpu_pending.sh names each run)
AB_SWITCHES = {
    "PEREGRINE_VERIFY_GEMM": Var(
        "triton", "cuBLAS above 16 rows",
        "Verify steps' GEMMs of 17 to 64 rows run on the skinny kernel's wide tile instead of cuBLAS.",
        "peregrine/decode/specialized.py"),
    "PEREGRINE_MLA_VERIFY_ROWS": Var(
        "0, 1, 2", "1",
        "Verify steps' MLA: query rows of one sequence per program. 2 lets two rows share each latent tile. "
        "0 is the older form, each row its own sequence.",
        "peregrine/decode/specialized.py"),
    "PEREGRINE_SAMPLE_SEARCH": Var(
        "candidates, radix, bisect", "candidates",
        "The sampler's threshold search.",
        "peregrine/kernels/sampling.py"),
    "PEREGRINE_SAMPLE_DESCENT_BLOCK": Var(
        "a number of elements", "sized per batch size",
        "The row slice each program of the sampler's descent weighs, fixed for every batch size.",
        "peregrine/kernels/sampling.py"),
    "PEREGRINE_MXFP4_V3_DECODE": Var(
        "asm, dot_scaled, plain", "asm",
        "How the v3 MXFP4 kernel decodes FP4 values on the GPU.",
        "peregrine/kernels/moe_mxfp4_v3.py"),
}

# read by the test suite's setup, not by the package
TEST_SWITCHES = {
    "PEREGRINE_FULL_SHAPES": Var(
        "1", "a representative subset on the CPU",
        "The CPU test pass runs every kernel shape. The GPU pass always does.",
        "tests/conftest.py"),
    "PEREGRINE_SLOW": Var(
        "1", "off",
        "Adds the long CPU tests: 4- and 8-rank tensor parallel, long sweeps. `-m slow` does the same.",
        "tests/conftest.py"),
}

# other programs' variables that peregrine reads
OTHER = {
    "VLLM_BATCH_INVARIANT": Var(
        "1", "off",
        "vLLM's switch for batch-invariant decoding, honoured as `--batch-invariant`: a request's tokens and logprobs "
        "do not depend on the requests beside it. docs/correctness.md says what it guarantees.",
        "peregrine/config.py"),
    "HF_HUB_CACHE": Var(
        "a folder", "$HF_HOME/hub",
        "Where `--model owner/name` looks for a Hugging Face download before it downloads one.",
        "peregrine/config.py"),
    "HF_HOME": Var(
        "a folder", "~/.cache/huggingface",
        "Hugging Face's home. Its hub/ folder is the cache when HF_HUB_CACHE is unset.",
        "peregrine/config.py"),
    "TRITON_INTERPRET": Var(
        "1", "off",
        "Kernels run under Triton's interpreter, on the CPU. tests/conftest.py sets it where there is no GPU.",
        "peregrine/kernels/__init__.py"),
    "RANK": Var(
        "set by torchrun", "unset",
        "With WORLD_SIZE and MASTER_ADDR: the process joins a tensor-parallel group started by torchrun.",
        "peregrine/parallel/launch.py"),
    "WORLD_SIZE": Var(
        "set by torchrun", "unset", "See RANK.", "peregrine/parallel/launch.py"),
    "MASTER_ADDR": Var(
        "set by torchrun", "unset", "See RANK.", "peregrine/parallel/launch.py"),
    "LOCAL_RANK": Var(
        "set by torchrun", "0", "The GPU of this host that the process uses.", "peregrine/parallel/launch.py"),
}

# variables peregrine sets itself, in every tensor-parallel rank: the lent machines need NVLink multicast off
SETS = {
    "NCCL_NVLS_ENABLE": Var("0", "", "NCCL's NVLink SHARP off.", "peregrine/parallel/launch.py"),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": Var("1", "", "Multicast off in torch's symmetric memory.",
                                            "peregrine/parallel/launch.py"),
    "NVSHMEM_DISABLE_NVLS": Var("1", "", "NVSHMEM's NVLink SHARP off.", "peregrine/parallel/launch.py"),
}

PACKAGE = {**SWITCHES, **AB_SWITCHES}  # every PEREGRINE_* variable peregrine/ reads
