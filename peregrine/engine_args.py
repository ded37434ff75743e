"""The engine options every engine-building command shares (`peregrine generate`, `serve`, `eval`):
add_engine_args puts them on a parser, engine_config turns the parsed arguments into an EngineConfig."""
from __future__ import annotations

import argparse

from .config import EngineConfig, preset_names, resolve_model
from .speculative.config import SpeculativeConfig

DEFAULT_MODEL = "peregrine-tiny"  # the trained checkable model that ships with its weights


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model folder (config.json + safetensors + tokenizer) or a preset: {', '.join(preset_names())} "
                        f"(default {DEFAULT_MODEL})")
    g.add_argument("--dummy-weights", action="store_true", help="seeded random weights instead of loading a checkpoint")
    g.add_argument("--max-num-seqs", type=int, default=8, help="most sequences running at once (default 8)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens prefilled per step while no request is decoding (default: the largest of "
                        "32768, 16384, 8192 whose activations fit beside the caches, at most what --max-model-len needs): longer chunks, fewer steps, "
                        "shorter time to first token; one prompt may fill a step, several share one up to 8192 tokens")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=EngineConfig.max_prefill_tokens_while_decoding,
                   metavar="N", help=f"prompt tokens in a step that also decodes running requests (default "
                                     f"{EngineConfig.max_prefill_tokens_while_decoding}): bounds their inter-token latency "
                                     "while another prompt prefills")
    g.add_argument("--prefill-piece-layers", type=int, default=None, metavar="N",
                   help="run such a step's prefill rows in pieces of N layers with a decode step of the running "
                        "requests between two pieces: they wait about one piece per token, not the whole chunk "
                        "(default on a GPU: as many layers as fit 12 ms, measured; on the CPU 6; 0: off)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="reuse the cached MLA blocks and KDA state snapshots of earlier prompts (default on)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="compute every prompt from its first token")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt+output per sequence (default on one GPU: the model's limit, or what half "
                        "the memory left after the weights holds for --max-num-seqs such sequences, said at start; "
                        "else min(model limit, 4096))")
    g.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization, metavar="F",
                   help=f"share of the GPU's memory the engine may use, weights included, as vLLM's (default "
                        f"{EngineConfig.gpu_memory_utilization}); what it leaves for the caches is said at start")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="a request's tokens and logprobs do not depend on the requests batched beside it, a prefix-"
                        "cache hit or how its prompt is chunked (docs/correctness.md); vLLM's VLLM_BATCH_INVARIANT=1 "
                        "turns it on too; costs speed, prefill most (fixed-tile GEMMs, the experts one at a time)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"], help="MLA latent cache dtype (auto = model dtype)")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", default=None, help="bf16 or fp32 (default: bf16 on cuda, fp32 on cpu)")
    g.add_argument("--seed", type=int, default=0, help="dummy-weight seed (default 0)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (default 1)")
    g.add_argument("--additional-config", default="", metavar="JSON",
                   help='engine options as JSON, e.g. \'{"decode_backend": "latency_specialized"}\'')
    g.add_argument("--speculative-config", default="", metavar="JSON",
                   help='speculative decoding (greedy and sampled requests), e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\', \'{"method": "suffix"}\' (suffix decoding: copies from the '
                        'context and from earlier answers) or \'{"method": "draft_model", "model": "tiny-kimi-linear", '
                        '"num_speculative_tokens": 4}\'; benchmarks only: "rejection_sample_method": "synthetic" with '
                        '"synthetic_acceptance_length"')


def engine_config(args) -> EngineConfig:
    """The engine options checked (ConfigError naming the option) before anything is built."""
    resolve_model(args.model)  # an unknown preset or a folder without config.json fails here, not after a load
    ecfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
                        prefill_piece_layers=args.prefill_piece_layers,
                        enable_prefix_caching=args.enable_prefix_caching,
                        kv_cache_dtype=args.kv_cache_dtype, device=args.device, dtype=args.dtype, seed=args.seed,
                        tensor_parallel_size=args.tensor_parallel_size,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    if getattr(args, "batch_invariant", None):
        ecfg.batch_invariant = True
    ecfg.apply_additional_config(args.additional_config)
    ecfg.speculative_config = SpeculativeConfig.parse(getattr(args, "speculative_config", "") or None)
    ecfg.validate()
    return ecfg
