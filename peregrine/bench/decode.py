"""`peregrine bench decode`: decode step time exactly as docs/benchmarks.md §1.

Per backend and batch size B: 4 prompt sets × 3 runs of B requests added
together (greedy, ignore EOS); a sample is the host time from one engine.step()
returning to the next one returning (the device synchronised once before the
run), so it is the full inter-token latency a user sees (schedule + forward +
sampling) and the engine's decode lookahead, which launches the next step
before reading this one's tokens, shows as it serves. Only steps where exactly
B sequences ran, all in decode, are kept. With lookahead on, one more run with
it off gives the same engine's synchronous step time (no_lookahead).
Cross-check: N CUDA-graph replays of the step timed with CUDA events
(runner.graph_replay_time), which must agree with the median within 5 %. Bytes per step come from the roofline model with
the distinct experts the run actually routed (runner.routed_experts_per_step).
"""
from __future__ import annotations

import gc
import random
import time
import traceback

import torch

from ..config import ConfigError, EngineConfig, resolve_model
from . import gpu, roofline, stats

PROMPT_SEED = 1234         # prompt set i uses seed PROMPT_SEED + i: same prompts for every backend
GRAPH_REPLAY_ITERS = 200   # replays timed for the cross-check
AGREE_PCT = 5.0            # docs/benchmarks.md §1: host median and graph replay must agree within this
ROUTING_TOKENS = 128      # the untimed routing-count run is capped here: routing does not depend on position
STEP_SLACK = 16            # extra steps allowed beyond input+output before a run is declared stuck


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(vocab: int, batch: int, input_len: int, set_idx: int) -> list[list[int]]:
    rng = random.Random(PROMPT_SEED + set_idx)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]


def run_batch(engine, prompts: list[list[int]], params, outputs: list | None = None) -> list[dict]:
    """Add the prompts together and step to completion; one record per forward step.
    outputs, when given, receives each prompt's output token ids (in prompt order)."""
    done: dict[str, list[int]] = {}
    ids = [engine.add_request(p, params, on_token=lambda o: o.finished and done.__setitem__(o.request_id, o.output_token_ids))
           for p in prompts]
    records, last = [], engine.last_step
    limit = len(prompts) * (len(prompts[0]) + params.max_tokens) + STEP_SLACK
    _sync()  # once: a sync between steps would stall a step launched ahead
    t0 = time.perf_counter()
    while engine.has_unfinished():
        if len(records) > limit:
            raise RuntimeError(f"run did not finish within {limit} steps")
        engine.step()
        t1 = time.perf_counter()
        dt, t0 = t1 - t0, t1
        info = engine.last_step
        if info is None or info is last:  # nothing was scheduled this step
            continue
        last = info
        records.append({"num_seqs": info.num_seqs, "num_prefill_tokens": info.num_prefill_tokens,
                        "num_decode_seqs": info.num_decode_seqs, "path": info.path, "duration_s": dt,
                        "engine_duration_s": info.duration_s, "new": info.num_new_tokens,
                        "drafted": info.num_draft_tokens, "accepted": info.num_accepted_tokens,
                        "lookahead": info.lookahead})
    if outputs is not None:
        outputs.extend(done[i] for i in ids)
    return records


def _no_lookahead(engine, prompts, params, batch: int) -> dict | None:
    """One timed run with decode lookahead off: the same engine's synchronous step time (None when
    the engine does not look ahead)."""
    if not getattr(engine, "lookahead", False):
        return None
    engine.lookahead = False
    try:
        recs = run_batch(engine, prompts, params)
    finally:
        engine.lookahead = True
    ms = [round(r["duration_s"] * 1e3, 4) for r in recs if stats.is_pure_decode(r, batch)]
    summ = stats.summarize(ms)
    return {"samples_ms": ms, "median_ms": summ["median"], "p90_ms": summ["p90"], "n": len(ms),
            "lookahead_steps": sum(1 for r in recs if r["lookahead"])}


def _routing(engine, prompts, params, batch: int) -> dict:
    """One untimed run with routing recorded: mean distinct experts per MoE layer over pure-decode steps.

    Contract with the runner: with runner.record_routing = True, every forward appends one
    entry (a list of distinct expert counts, one per MoE layer) to routed_experts_per_step()."""
    runner = engine.runner
    if not hasattr(runner, "routed_experts_per_step"):
        return {"source": "uniform estimate (runner does not count routed experts)", "per_layer": None}
    n0 = len(runner.routed_experts_per_step())
    runner.record_routing = True
    try:
        records = run_batch(engine, prompts, params)
    finally:
        runner.record_routing = False
    entries = list(runner.routed_experts_per_step())[n0:]
    if len(entries) == len(records):
        kept = [e for e, r in zip(entries, records) if stats.is_pure_decode(r, batch)]
        source = "counted (pure decode steps)"
    else:
        kept = entries
        source = f"counted (all {len(entries)} steps: could not align with {len(records)} engine steps)"
    if not kept:
        return {"source": "uniform estimate (no routing recorded)", "per_layer": None}
    per_layer = [sum(col) / len(kept) for col in zip(*kept)]
    return {"source": source, "per_layer": per_layer, "steps": len(kept)}


def _bench_batch(engine, cfg, batch, input_len, output_len, prompt_sets, runs, kv_dtype, copy_gbps, backend, log,
                 sampling: dict | None = None) -> dict:
    """sampling: SamplingParams fields for every row (temperature, top_p, top_k, min_p, logprobs; the engine
    seeds each request); None: greedy."""
    from ..engine.request import SamplingParams
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **(sampling or {"temperature": 0.0}))
    # one full untimed run first: compiles, autotuning and the graph captures of every
    # context bucket the timed runs will reach stay out of the samples
    run_batch(engine, _prompts(cfg.vocab_size, batch, input_len, 0), params)
    samples, run_medians, paths, ahead = [], [], {}, 0
    for s in range(prompt_sets):
        prompts = _prompts(cfg.vocab_size, batch, input_len, s)
        for _ in range(runs):
            recs = run_batch(engine, prompts, params)
            kept = [r for r in recs if stats.is_pure_decode(r, batch)]
            ms = [round(r["duration_s"] * 1e3, 4) for r in kept]  # 0.1 µs resolution keeps files small
            for r in kept:
                paths[r["path"]] = paths.get(r["path"], 0) + 1
            samples += ms
            if ms:
                run_medians.append(stats.summarize(ms)["median"])
            ahead += sum(1 for r in kept if r["lookahead"])
    summ = stats.summarize(samples)
    if not summ["n"]:
        raise RuntimeError(f"no step ran with exactly {batch} sequences all in decode (output_len {output_len} too short?)")
    med = summ["median"]
    out = {"batch": batch, "samples_ms": samples, "run_medians_ms": run_medians, "paths": paths,
           "median_ms": med, "p90_ms": summ["p90"], "p99_ms": summ["p99"], "mean_ms": summ["mean"],
           "n": summ["n"], "tok_s_user": 1e3 / med, "lookahead_steps": ahead,
           "no_lookahead": _no_lookahead(engine, _prompts(cfg.vocab_size, batch, input_len, 0), params, batch)}
    if backend not in paths or len(paths) > 1:
        log(f"WARNING: backend {backend} B={batch}: measured steps ran on paths {paths} "
            f"(fallbacks: {engine.stats.get('fallback_reasons')})")
    # cross-check against graph replays timed with CUDA events
    runner = engine.runner
    replay = None
    if torch.cuda.is_available() and hasattr(runner, "graph_replay_time"):
        # None: no graph captured for B; a sampled run times the graph that draws its rows
        replay = runner.graph_replay_time(batch, GRAPH_REPLAY_ITERS, sampled=bool(sampling))
        replay = None if replay is None else float(replay)
    out["graph_replay_ms"] = replay
    out["agreement_pct"] = None if replay is None else (med - replay) / replay * 100
    out["agrees"] = None if replay is None else abs(out["agreement_pct"]) <= AGREE_PCT
    if replay is None:
        out["graph_replay_note"] = ("no CUDA" if not torch.cuda.is_available() else
                                    "runner has no graph_replay_time" if not hasattr(runner, "graph_replay_time")
                                    else "runner captured no graph for this B")
        if torch.cuda.is_available():
            log(f"WARNING: backend {backend} B={batch}: no graph-replay cross-check ({out['graph_replay_note']})")
    elif not out["agrees"]:
        log(f"WARNING: backend {backend} B={batch}: median step {med:.3f} ms and graph replay {replay:.3f} ms "
            f"disagree by {out['agreement_pct']:+.1f} % (> {AGREE_PCT} %): the harness measures host gaps, sync or sampling")
    # roofline: bytes this step must move, with the experts actually routed
    rparams = SamplingParams(temperature=0.0, max_tokens=min(output_len, ROUTING_TOKENS), ignore_eos=True)
    rt = _routing(engine, _prompts(cfg.vocab_size, batch, input_len, 0), rparams, batch)
    per_layer = rt["per_layer"]
    distinct = per_layer if per_layer is not None else roofline.expected_distinct(
        cfg.num_experts, cfg.num_experts_per_token, batch)
    ctx = input_len + output_len / 2  # mean cache length over the decode steps
    ranks = getattr(getattr(engine, "engine_cfg", None), "tensor_parallel_size", 1)  # TP: bytes one rank reads (its own HBM)
    nbytes = roofline.step_bytes(cfg, batch, distinct, ctx, kv_dtype, tp=ranks)
    out.update({"distinct_experts_source": rt["source"], "distinct_experts_per_layer": per_layer,
                "distinct_experts_mean": (sum(per_layer) / len(per_layer)) if per_layer else distinct,
                "mean_context": ctx, "bytes_per_step": nbytes,
                "achieved_gbps": nbytes / (med * 1e-3) / 1e9})
    out["pct_copy_bw"] = out["achieved_gbps"] / copy_gbps * 100 if copy_gbps else None
    pct = f"{out['pct_copy_bw']:.1f} % of copy BW" if out["pct_copy_bw"] is not None else "copy BW n/a"
    sync = out["no_lookahead"]
    label = backend + (" " + ",".join(f"{k}={v}" for k, v in sampling.items()) if sampling else "")
    out["sampling"] = sampling or None
    log(f"{label:>20} B={batch:<3} median {med:.3f} ms  p90 {summ['p90']:.3f} ms  "
        f"{out['tok_s_user']:.1f} tok/s/user  {out['achieved_gbps']:.0f} GB/s ({pct})"
        + (f"  lookahead {ahead}/{summ['n']} steps; off: median {sync['median_ms']:.3f} ms" if sync and sync["n"] else ""))
    return out


def _default_builder(model, engine_cfg, dummy_weights, log):
    from ..engine.build import build_engine  # the lead's module; imported late so CPU tests can inject one
    return build_engine(model, engine_cfg, dummy_weights=dummy_weights, log=log)


def bench_decode(model: str, batch_sizes: list[int], input_len: int = 1, output_len: int = 1024,
                 backends: tuple[str, ...] = ("standard", "latency_specialized"), dummy_weights: bool = False,
                 prompt_sets: int = 4, runs: int = 3, engine_overrides: dict | None = None,
                 kv_cache_dtype: str = "auto", additional_config: str | dict | None = None,
                 results_dir: str | None = "results", builder=None, log=print, sampling: dict | None = None,
                 also_logprobs: int | None = None) -> dict:
    """Run the decode benchmark; returns the result dict (also written under results_dir unless None).
    sampling: SamplingParams fields (temperature, top_p, top_k, min_p, logprobs): every B is measured greedy
    and then with these settings on the same engine (each backend's "sampled_batches"); also_logprobs N: then
    sampled once more with logprobs N ("sampled_logprobs_batches"), so all three ratios come from one engine."""
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ConfigError(f"batch sizes must be positive integers, got {batch_sizes}")
    if input_len < 1 or output_len < 2:
        raise ConfigError(f"need input_len >= 1 and output_len >= 2 (got {input_len}, {output_len})")
    if prompt_sets < 1 or runs < 1:
        raise ConfigError(f"need prompt_sets >= 1 and runs >= 1 (got {prompt_sets}, {runs})")
    if also_logprobs is not None and not sampling:
        raise ConfigError("also_logprobs measures sampled rows with logprobs: give the sampling settings too")
    variants = [("sampled_batches", sampling)] if sampling else []
    if also_logprobs is not None:
        variants.append(("sampled_logprobs_batches", {**sampling, "logprobs": also_logprobs}))
    cfg, _ = resolve_model(model)  # a bad model name fails here, not as "backend not available"
    builder = builder or _default_builder
    copy = gpu.copy_bandwidth() if torch.cuda.is_available() else None
    copy_gbps = copy["gbps"] if copy else None
    if copy:
        log(f"copy bandwidth {copy_gbps:.0f} GB/s (same run)")
    result = {
        "kind": "decode", "model": cfg.name, "metadata": gpu.run_metadata(),
        "tensor_parallel_size": (engine_overrides or {}).get("tensor_parallel_size", 1),
        "config": {"batch_sizes": list(batch_sizes), "input_len": input_len, "output_len": output_len,
                   "backends": list(backends), "prompt_sets": prompt_sets, "runs": runs,
                   "dummy_weights": dummy_weights, "kv_cache_dtype": kv_cache_dtype,
                   "additional_config": additional_config, "engine_overrides": engine_overrides or {},
                   "sampling": sampling or None, "also_logprobs": also_logprobs},
        "copy_bandwidth": copy,
        "roofline": {"non_routed_bytes_b1": roofline.non_routed_step_bytes(cfg, 1),
                     "expert_bytes": roofline.expert_bytes(cfg), "moe_layers": len(cfg.moe_layers)},
        "backends": {},
    }
    for backend in backends:
        ecfg = EngineConfig(max_num_seqs=max(batch_sizes), max_decode_batch=min(16, max(batch_sizes)),
                            kv_cache_dtype=kv_cache_dtype, max_model_len=input_len + output_len + 1)
        if additional_config:
            ecfg.apply_additional_config(additional_config)
        for k, v in (engine_overrides or {}).items():
            if not hasattr(ecfg, k):
                raise ConfigError(f"unknown engine option '{k}'")
            setattr(ecfg, k, v)
        ecfg.decode_backend = backend
        try:
            engine, _tok = builder(model, ecfg, dummy_weights, log)
        except (ConfigError, NotImplementedError) as e:
            log(f"WARNING: backend {backend} is not available: {e}")
            result["backends"][backend] = {"status": "not available", "reason": str(e)}
            continue
        entry = {"status": "ok", "batches": []}
        result["backends"][backend] = entry
        try:
            for B in batch_sizes:
                entry["batches"].append(_bench_batch(engine, cfg, B, input_len, output_len, prompt_sets, runs,
                                                     kv_cache_dtype, copy_gbps, backend, log))
                for key, params in variants:  # the same engine and B right after the greedy one: same-run ratios
                    sb = _bench_batch(engine, cfg, B, input_len, output_len, prompt_sets, runs, kv_cache_dtype,
                                      copy_gbps, backend, log, params)
                    sb["vs_greedy"] = sb["median_ms"] / entry["batches"][-1]["median_ms"]
                    entry.setdefault(key, []).append(sb)
                    what = "sampled" + (f" + logprobs {params['logprobs']}" if params.get("logprobs") else "")
                    log(f"{backend:>20} B={B:<3} {what} / greedy step: {sb['vs_greedy']:.3f}")
            entry["engine_stats"] = {k: dict(v) if isinstance(v, dict) else v for k, v in engine.stats.items()}
        except Exception as e:  # keep what was measured; the error is reported, not hidden
            log(f"WARNING: backend {backend} failed: {e!r}")
            entry.update(status="error", reason=repr(e), traceback=traceback.format_exc())
        finally:
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # both backends' weights at once would not fit for 48B
    result["ratios"] = backend_ratios(result)
    if results_dir is not None:
        from .report import markdown_table
        tp = (engine_overrides or {}).get("tensor_parallel_size", 1)
        path = gpu.write_result(gpu.result_path(cfg.name + (f"-tp{tp}" if tp > 1 else ""), "decode", results_dir), result)
        md = path.with_suffix(".md")
        md.write_text(markdown_table([result]))
        result["paths"] = {"json": str(path), "md": str(md)}
        log(f"wrote {path} and {md}")
    return result


def backend_ratios(result: dict) -> dict:
    """standard / latency_specialized median step time per B (both measured in this run)."""
    bk = result["backends"]
    a, b = bk.get("standard", {}), bk.get("latency_specialized", {})
    if not a.get("batches") or not b.get("batches"):
        return {}
    sb = {x["batch"]: x["median_ms"] for x in b["batches"]}
    return {str(x["batch"]): x["median_ms"] / sb[x["batch"]] for x in a["batches"] if x["batch"] in sb}
