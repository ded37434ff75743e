"""One rank's engine parts from a preset or model folder: the model (the rank's shard under tensor
parallel) with its weights, the caches sized to the memory left, the runner. Rank 0 builds them inside
build_engine (engine/build.py), the other ranks on its word (parallel/worker.py)."""
from __future__ import annotations

import math
import time

import torch

from ..cache import ModelCache
from ..config import PREFILL_STEP_TOKENS, EngineConfig, resolve_model
from ..errors import ConfigError
from ..models.kimi import KimiModel
from ..models.loader import init_dummy_weights, load_weights
from ..parallel.group import SINGLE
from ..parallel.shard import describe, holdings

DEFAULT_MAX_MODEL_LEN = 4096  # without a GPU's free memory to size by (the CPU; tensor parallel: ranks must agree)
CONTEXT_MEMORY_SHARE = 0.5    # on one GPU the default max_model_len gives max_num_seqs full-length sequences' cache and
#                               a prefill's context this share of the memory left after the weights (the rest: steps,
#                               snapshots, prefix-cache slack); agent sessions run 24K-150K tokens (#65 item 4)
DEFAULT_SNAPSHOTS = 64        # KDA snapshots for prefix caching: ~one per 8K-token chunk of 8 x 64K contexts
SNAPSHOT_MEMORY_SHARE = 0.5   # at most this share of the memory left after the caches goes to snapshots
STEP_SLACK = 1.5              # step_bytes leaves out the allocator's fragmentation and small temporaries
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


def pick_device(engine_cfg: EngineConfig) -> torch.device:
    if engine_cfg.device:
        dev = torch.device(engine_cfg.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but no CUDA GPU is available")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(engine_cfg: EngineConfig, dev: torch.device) -> torch.dtype:
    if engine_cfg.dtype:
        if engine_cfg.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {engine_cfg.dtype!r}")
        return DTYPES[engine_cfg.dtype]
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def report_holdings(tp, model, error: str | None, log) -> list[dict]:
    """Every rank says what it holds (or why its build failed); rank 0 prints it all."""
    import torch.distributed as dist
    mine = {"error": error} if model is None else holdings(model)
    every = [None] * tp.world
    dist.all_gather_object(every, mine, group=tp.ctrl)
    bad = [f"rank {r}: {h['error']}" for r, h in enumerate(every) if "error" in h]
    if bad:
        raise ConfigError("tensor-parallel build failed: " + "; ".join(bad))
    if tp.rank == 0:
        for h in every:
            log(describe(h))
    return every


def build_parts(model: str, ecfg: EngineConfig, dummy_weights: bool, log, tp=SINGLE):
    """One rank's (global config, model shard, caches, runner, weights folder)."""
    cfg, folder = resolve_model(model)
    tp = tp.with_slicing(getattr(ecfg, "tp_slice_replicated", False))  # this engine's choice; same group
    dev = tp.device if tp.world > 1 else pick_device(ecfg)
    dtype = pick_dtype(ecfg, dev)
    auto_len = ecfg.max_model_len is None
    if auto_len:  # provisional: on one GPU sized to its memory once the weights are in (default_context)
        ecfg.max_model_len = min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    elif ecfg.max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len {ecfg.max_model_len} exceeds the model's limit {cfg.max_position_embeddings}")
    if not dummy_weights and folder is None:
        raise ConfigError(f"preset '{model}' ships no weights: pass --dummy-weights, or a model folder with safetensors")

    t0 = time.time()
    log(f"building {cfg.name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts top-{cfg.num_experts_per_token}) on {dev} in {str(dtype).split('.')[-1]}"
        + (f", tensor parallel {tp.world}" if tp.world > 1 else ""))
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    mem0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    try:
        with torch.device(dev):
            m = KimiModel(cfg, dtype, tp).eval()
        lcfg = m.cfg  # this rank's shard (the model's config when tp is off)
        nparams = sum(p.numel() for p in m.parameters())
        if dummy_weights:
            log(f"initialising {nparams / 1e9:.2f}B parameters with seeded dummy weights (seed {ecfg.seed})")
            init_dummy_weights(m, seed=ecfg.seed, log=log)
        else:
            log(f"loading {nparams / 1e9:.2f}B parameters from {folder}")
            load_weights(m, folder, log=log)
    except torch.cuda.OutOfMemoryError as e:  # the weights alone exceed the card: a user's choice, not a crash
        total = f" ({gib(torch.cuda.get_device_properties(dev).total_memory)} in all)" if dev.type == "cuda" else ""
        raise ConfigError(f"the weights of {cfg.name} do not fit on {dev}{total}: split them with "
                          f"--tensor-parallel-size, or use a GPU with more memory (`peregrine plan --model {model}` "
                          "says what fits)") from e
    if ecfg.extra.get("lm_head_scale"):  # checks only: sharper dummy logits, confident greedy choices
        with torch.no_grad():
            m.lm_head.mul_(float(ecfg.extra["lm_head_scale"]))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        log(f"weights: {gib(torch.cuda.memory_allocated(dev) - mem0)} on the GPU")
    log(f"weights ready in {time.time() - t0:.1f}s")

    if auto_len and dev.type == "cuda" and tp.world == 1:
        ecfg.max_model_len = default_context(cfg, lcfg, ecfg, dtype, memory_budget(dev, ecfg.gpu_memory_utilization))
        log(f"max_model_len {ecfg.max_model_len} (the model's limit {cfg.max_position_embeddings}; what "
            f"{CONTEXT_MEMORY_SHARE:.0%} of the memory budget holds for {ecfg.max_num_seqs} full-length sequences; "
            "--max-model-len sets it)")
    elif auto_len:
        log(f"max_model_len {ecfg.max_model_len} (default {DEFAULT_MAX_MODEL_LEN} without one GPU's memory to size by; "
            "--max-model-len sets it)")
    blocks_per_seq = math.ceil(ecfg.max_model_len / ecfg.block_size)
    num_blocks = ecfg.num_cache_blocks or ecfg.max_num_seqs * blocks_per_seq
    per_slot = ModelCache.bytes_per_slot(lcfg, dtype)
    need = num_blocks * ecfg.block_size * ModelCache.bytes_per_token(lcfg, ecfg.kv_cache_dtype, dtype) + \
        ecfg.max_num_seqs * per_slot
    snaps = ecfg.prefix_cache_snapshots if ecfg.prefix_cache_snapshots is not None else DEFAULT_SNAPSHOTS
    if not ecfg.enable_prefix_caching or not lcfg.kda_layers:
        snaps = 0
    room = None
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        budget = memory_budget(dev, ecfg.gpu_memory_utilization)
        log(f"GPU memory: {gib(total)} in all, {gib(torch.cuda.memory_reserved(dev))} held by the weights, {gib(free)} "
            f"free; --gpu-memory-utilization {ecfg.gpu_memory_utilization:g} leaves {gib(budget)} for the caches, "
            "snapshots and activations")
        if need > budget:
            raise ConfigError(f"caches need {gib(need)} but --gpu-memory-utilization {ecfg.gpu_memory_utilization:g} "
                              f"leaves {gib(budget)}: lower --max-model-len or --max-num-seqs, or raise "
                              "--gpu-memory-utilization")
        room = budget - need
    ecfg.max_num_batched_tokens = pick_step_tokens(ecfg, lcfg, dtype, room, tp.world, log)
    if dev.type == "cuda":
        room -= min(room, step_bytes(lcfg, ecfg.max_num_batched_tokens, ecfg.max_model_len, dtype))
        # the default pool shrinks to what fits beside a step's activations (one GPU: under TP every rank
        # must hold the same pool)
        if ecfg.prefix_cache_snapshots is None and per_slot and tp.world == 1:
            snaps = min(snaps, max(0, int(room * SNAPSHOT_MEMORY_SHARE // per_slot)))
        if snaps * per_slot + need > budget:
            raise ConfigError(f"{snaps} prefix-cache snapshots need {gib(snaps * per_slot)} more than is free: "
                              "lower prefix_cache_snapshots")
    cache = ModelCache(lcfg, num_blocks=num_blocks, block_size=ecfg.block_size, num_slots=ecfg.max_num_seqs,
                       dtype=dtype, device=dev, kv_cache_dtype=ecfg.kv_cache_dtype, num_snapshots=snaps)
    log(f"caches: {num_blocks} blocks x {ecfg.block_size} tokens ({ecfg.kv_cache_dtype} latent), "
        f"{ecfg.max_num_seqs} KDA state slots, prefill steps of up to {ecfg.max_num_batched_tokens} tokens, "
        + (f"prefix caching on ({snaps} KDA snapshots of {gib(per_slot)}), " if ecfg.enable_prefix_caching
           else "prefix caching off, ") + f"{gib(cache.nbytes())}")
    runner = make_runner(m, cache, ecfg, log)
    return cfg, m, cache, runner, folder


def memory_budget(dev, utilization: float) -> int:
    """Bytes the caches, snapshots and activations may take, as vLLM's --gpu-memory-utilization means it: that share
    of the GPU's whole memory less what this process holds already (the weights), at most what is free."""
    free, total = torch.cuda.mem_get_info(dev)
    return max(0, min(free, int(total * utilization) - torch.cuda.memory_reserved(dev)))


def default_context(cfg, lcfg, ecfg: EngineConfig, dtype: torch.dtype, budget: int) -> int:
    """The default max_model_len on one GPU with `budget` bytes for everything but the weights (memory_budget): the
    model's limit, or the longest context (whole blocks, at least DEFAULT_MAX_MODEL_LEN) whose max_num_seqs sequences'
    cache and a prefill's context activations fit CONTEXT_MEMORY_SHARE of it."""
    per_token = (ModelCache.bytes_per_token(lcfg, ecfg.kv_cache_dtype, dtype) * ecfg.max_num_seqs
                 + step_bytes(lcfg, 0, 1, dtype))
    fit = int(budget * CONTEXT_MEMORY_SHARE) // per_token // ecfg.block_size * ecfg.block_size
    return min(cfg.max_position_embeddings, max(fit, DEFAULT_MAX_MODEL_LEN))


def step_bytes(cfg, tokens: int, max_model_len: int, dtype: torch.dtype) -> int:
    """Rough peak activation bytes of one prefill step of `tokens` tokens (STEP_SLACK included): the larger
    of a KDA layer's projections, conv outputs and fla's per-token intermediates, and the MoE's sorted
    token-expert rows (xs, gate|up, h, ys) and routing, plus the residual streams; MLA's expanded keys and
    values of the whole context on top (they scale with the context, not the step)."""
    b, D = dtype.itemsize, cfg.hidden_size
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    kda = (3 * H * d + 2 * d + H + H * d) + 3 * H * d * 2 + 6 * H * d if cfg.kda_layers else 0  # in_proj, f|r, conv + copies, fla
    mla = cfg.mla_num_heads * (cfg.qk_head_dim + cfg.v_head_dim) + cfg.latent_dim + 2 * cfg.mla_num_heads * cfg.v_head_dim
    Dz, I, k = cfg.routed_expert_hidden_size or D, cfg.moe_intermediate_size, cfg.num_experts_per_token
    moe = k * (2 * Dz + 3 * I) + cfg.num_experts * 6 + k * 16 if cfg.num_experts else 0
    per_token = max(kda, mla, moe) * b + 4 * D * 4
    ctx = max_model_len * (cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + cfg.latent_dim) * b
    return int(STEP_SLACK * (tokens * per_token + ctx))


def pick_step_tokens(ecfg: EngineConfig, cfg, dtype, room: float | None, tp_world: int, log) -> int:
    """--max-num-batched-tokens: the user's value (a warning when its step may not fit in `room`, the bytes
    left after the caches), else the largest PREFILL_STEP_TOKENS that fits, at most max_model_len (but not
    below the smallest: prompts pack up to it); tensor parallel: the smallest, the same on every rank
    whatever each has free."""
    want = ecfg.max_num_batched_tokens
    if want is not None:
        if room is not None and step_bytes(cfg, want, ecfg.max_model_len, dtype) > room:
            log(f"WARNING: a prefill step of {want} tokens may need ~{gib(step_bytes(cfg, want, ecfg.max_model_len, dtype))} "
                f"of activations and {gib(room)} is left beside the caches: lower --max-num-batched-tokens if it runs "
                "out of memory")
        return want
    if tp_world > 1:
        return PREFILL_STEP_TOKENS[-1]
    # no step is longer than one prompt or several packed ones (the scheduler's pack): no larger budget is of use
    cap = max(ecfg.max_model_len, PREFILL_STEP_TOKENS[-1])
    fits = [min(n, cap) for n in PREFILL_STEP_TOKENS
            if room is None or step_bytes(cfg, min(n, cap), ecfg.max_model_len, dtype) <= room]
    return fits[0] if fits else PREFILL_STEP_TOKENS[-1]


def make_runner(model, cache, ecfg: EngineConfig, log):
    from ..decode.standard import StandardRunner
    max_blocks = min(math.ceil(ecfg.max_model_len / ecfg.block_size), cache.num_blocks)
    standard = StandardRunner(model, cache, cuda_graphs=ecfg.cuda_graphs, max_graph_batch=ecfg.max_decode_batch, log=log,
                              prefill_graph_tokens=ecfg.max_num_batched_tokens if ecfg.prefill_graphs else 0,
                              batch_invariant=ecfg.batch_invariant, max_len=max_blocks * cache.block_size)
    if ecfg.decode_backend == "standard" and ecfg.batch_invariant and cache.latent.is_cuda:
        # the standard path's invariant decode is eager and row by row: the fused path serves decode at full speed
        log("batch invariant: decode steps on latency_specialized (the standard path's invariant decode is eager, "
            "one row at a time)")
        ecfg.decode_backend = "latency_specialized"
        ecfg.validate()
    if ecfg.decode_backend == "standard":
        return standard
    from ..decode.specialized import SpecializedRunner
    return SpecializedRunner(model, cache, standard, max_batch=ecfg.max_decode_batch, cuda_graphs=ecfg.cuda_graphs, log=log,
                             max_blocks=max_blocks,
                             allreduce=ecfg.tp_allreduce, pdl=ecfg.pdl, batch_invariant=ecfg.batch_invariant)
