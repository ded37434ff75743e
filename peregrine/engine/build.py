"""Build a ready engine from a preset or model folder: tokenizer, each rank's parts (engine/parts.py:
config, weights, caches, runner), the tensor-parallel ranks, the engine."""
from __future__ import annotations

from ..config import INVARIANT_ALIGN, EngineConfig, resolve_model
from ..parallel.group import SINGLE, TPGroup
from ..parallel.slicing import shard_config
from ..tokenizer import load_tokenizer
from .engine import LLMEngine
from .parts import build_parts, pick_device, report_holdings


def build_engine(model: str, engine_cfg: EngineConfig | None = None, dummy_weights: bool = False, log=print):
    """-> (LLMEngine, tokenizer). Raises ConfigError for user mistakes.

    tensor_parallel_size N > 1: this process is rank 0; the other ranks (spawned here, or
    started by torchrun) build their shards of the same engine and follow its steps."""
    ecfg = engine_cfg or EngineConfig()
    ecfg.validate()
    cfg0, folder0 = resolve_model(model)
    tok = load_tokenizer(cfg0.vocab_size, folder0, dummy_weights)  # a missing tokenizer fails before any weight loads
    log(f"tokenizer: {tok.kind}")
    tp = SINGLE
    if ecfg.tensor_parallel_size > 1:
        from ..parallel.launch import ensure_group
        cfg, _ = resolve_model(model)
        shard_config(cfg, TPGroup(0, ecfg.tensor_parallel_size))  # a size that does not divide fails before any launch
        tp = ensure_group(ecfg.tensor_parallel_size, pick_device(ecfg).type)
        from ..parallel import control
        control.send_obj(tp, ("build", model, ecfg, dummy_weights, False))
        try:
            parts = build_parts(model, ecfg, dummy_weights, log, tp)
        except Exception as e:
            report_holdings(tp, None, f"{type(e).__name__}: {e}", log)  # the other ranks wait for this
            raise
        holdings = report_holdings(tp, parts[1], None, log)
    else:
        parts = build_parts(model, ecfg, dummy_weights, log, tp)
    cfg, m, cache, runner, folder = parts
    if tp.world > 1:
        from ..parallel.driver import TPDriver
        runner = TPDriver(runner, tp)
    engine = LLMEngine(runner, cfg, ecfg, cache, tokenizer=tok)
    if ecfg.batch_invariant:
        log("batch invariant: prefill " + ("in PyTorch's invariant forms" if m.lm_head.device.type == "cpu" else
            "through fixed-tile GEMMs, the flash attention without KV splits and fla's KDA chunks") +
            f", prompts split only at multiples of {INVARIANT_ALIGN} tokens, decode on {ecfg.decode_backend}, "
            "prefix reuse of prompt blocks only (docs/correctness.md §5)")
    if engine.spec is not None and engine.spec.rates is not None:
        log(engine.spec.synthetic_note)  # at start, where the operator reads it
    engine.model = m
    engine.tp_holdings = holdings if tp.world > 1 else None  # what every rank holds (parallel/shard.py)
    return engine, tok


def warm_up(engine, log=print) -> None:
    """A server's start-up work that would otherwise land on its first requests: the prefill graphs of every
    token bucket, and the cuDNN plans of cold MLA rows."""
    pg = getattr(getattr(engine.runner, "standard", engine.runner), "prefill", None)
    if pg is not None:
        pg.warm_up()
    warm_cold_attention(engine, log)
    if getattr(engine, "spec", None) is not None:  # the verify width chooser's cost table (GPU graphs only)
        engine.spec.measure_costs(log)
        graphs = getattr(engine.spec.drafter, "graphs", None)  # a DFlash / DSpark drafter's step graphs per B
        if graphs is not None:
            graphs.warm_up(max(engine.engine_cfg.max_num_seqs, 1), log)


def warm_cold_attention(engine, log=print) -> int:
    """The cuDNN plans of cold MLA rows up to the longest prefill step (kernels/mla_prefill_sdpa.py) -> plans."""
    from ..models.mla import MLA
    model, ecfg = getattr(engine, "model", None), engine.engine_cfg
    mla = next((m for m in model.modules() if isinstance(m, MLA)), None) if model is not None else None
    if mla is None or ecfg.tensor_parallel_size > 1:  # TP steps stay under the route's MIN_T
        return 0
    return mla.warm_cold_attention(min(ecfg.max_model_len, ecfg.max_num_batched_tokens or ecfg.max_model_len), log)
