"""`peregrine bench ttft`: time to first token, cold and on turn 2 (docs/benchmarks.md §3b).

B = 1. Per prompt length: `runs` fresh random prompts, each timed from add_request to its first
token (max_tokens 1, the engine's own clock), then "turn 2": the same prompt + 64 new tokens sent
right after, which prefix caching serves from the cached blocks and KDA snapshots. Medians and raw
samples. Every length is warmed up first with a prompt of its own (compiles, autotuning).

Then one cold prefill (default 32K), eager, with CUDA events around every layer and MLP module: time per
layer type against its floors, the compute floor (its FLOPs at PEAK_TFLOPS) and the weight-read floor
(its weights once per step at the copy bandwidth measured in the same run). A user's turn at that
length = TTFT + output tokens x ITL is quoted with the decode step measured here too.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

import torch

PEAK_TFLOPS = 790.0   # H200 dense BF16 matmul measured on random data (docs/development.md)
TURN2_NEW_TOKENS = 64  # docs/benchmarks.md §3b
KDA_CHUNK = 64         # chunk of the chunked KDA form (fla's default) for its FLOP count
TYPES = ("kda", "mla", "moe", "dense", "other")


class GCWatch:
    """The garbage collections (generation, ms) that ran inside a with-block: host time the GPU may wait on."""

    def __enter__(self):
        self.runs, self._t0 = [], 0.0
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.runs.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def summary(self) -> list[list]:
        return [[g, round(ms, 2)] for g, ms in self.runs]


def first_token_s(engine, prompt: list[int]) -> float:
    from ..engine import SamplingParams
    done = []
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), on_token=lambda o: done.append(time.perf_counter()))
    while not done:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return done[0] - t0


def chunks_of(length: int, budget: int, start: int = 0) -> list[tuple[int, int]]:
    """(start, n) of each prefill step of one prompt alone (no decodes running)."""
    out = []
    while start < length:
        n = min(budget, length - start)
        out.append((start, n))
        start += n
    return out


def prefill_flops(cfg, chunks) -> dict[str, float]:
    """FLOPs per layer type of a prefill done in these chunks (matmuls as 2·m·n·k; MLA attention over the
    causally visible pairs; KDA's chunked recurrence as 6d² + 10Cd + C² per token and head)."""
    D, H, d = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    rank = d
    g_w = H * d if cfg.kda_full_rank_gate else rank
    kda_w = D * (3 * H * d + rank + g_w + H) + rank * H * d + (0 if cfg.kda_full_rank_gate else rank * H * d) + H * d * D
    Hm, qk, vd, r = cfg.mla_num_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    mla_w = D * ((cfg.q_lora_rank or Hm * qk) + cfg.latent_dim + (Hm * vd if cfg.mla_output_gate else 0)) + Hm * vd * D
    if cfg.q_lora_rank:
        mla_w += cfg.q_lora_rank * Hm * qk
    I, k, E = cfg.moe_intermediate_size, cfg.num_experts_per_token, cfg.num_experts
    Dz = cfg.routed_expert_hidden_size or D
    moe_w_tok = D * E + k * 3 * Dz * I + 3 * D * I * cfg.num_shared_experts + (2 * D * Dz if cfg.routed_expert_hidden_size else 0)
    dense_w = 3 * D * cfg.intermediate_size
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.num_hidden_layers - n_moe
    out = dict.fromkeys(TYPES, 0.0)
    for s, n in chunks:
        out["kda"] += n_kda * (2 * n * kda_w + n * H * (6 * d * d + 10 * KDA_CHUNK * d + KDA_CHUNK ** 2) * 2)
        pairs = n * s + n * (n + 1) / 2
        # the latent expanded to keys/values once per token (the floor; the layer re-expands the prefix per chunk)
        out["mla"] += n_mla * (2 * n * mla_w + 2 * n * r * Hm * (cfg.qk_nope_head_dim + vd) + 2 * Hm * (qk + vd) * pairs)
        out["moe"] += n_moe * 2 * n * moe_w_tok
        out["dense"] += n_dense * 2 * n * dense_w
    out["other"] = 2 * D * cfg.vocab_size  # lm_head of the last token
    return out


def weight_bytes(model) -> dict[str, float]:
    """Bytes of weights per layer type (every routed expert counted: a long chunk touches all of them)."""
    out = dict.fromkeys(TYPES, 0.0)
    for layer in model.layers:
        out["kda" if layer.is_kda else "mla"] += sum(p.numel() * p.element_size() for p in layer.attn.parameters())
        out["moe" if layer.is_moe else "dense"] += sum(p.numel() * p.element_size() for p in layer.mlp.parameters())
    out["other"] = sum(p.numel() * p.element_size() for p in (model.lm_head, model.embed_tokens)) / 2  # lm_head only
    return out


class LayerTimer:
    """CUDA events around each decoder layer and its MLP module, summed per layer type after a sync: the
    MLP's span counts for its type (moe / dense), the rest of the layer's (its attention with the two norms
    and residual adds) for its attention type (kda / mla). Layers call attention as pre / core / post, not
    as a module, so the layer's span minus its MLP's is the attention's."""

    def __init__(self, model):
        self.spans: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []  # (attention, mlp type, ...)
        self.handles = []
        for layer in model.layers:
            attn, mlp = ("kda" if layer.is_kda else "mla"), ("moe" if layer.is_moe else "dense")
            for mod, kinds in ((layer, (attn, None)), (layer.mlp, (None, mlp))):
                self.handles.append(mod.register_forward_pre_hook(self._pre(kinds)))
                self.handles.append(mod.register_forward_hook(self._post))
        self._open = []  # a layer's span is open around its MLP's

    def _pre(self, kinds):
        def hook(mod, args):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._open.append((kinds, e))
        return hook

    def _post(self, mod, args, out):
        kinds, a = self._open.pop()
        b = torch.cuda.Event(enable_timing=True)
        b.record()
        self.spans.append((*kinds, a, b))

    def totals_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        out = dict.fromkeys(TYPES, 0.0)
        for attn, mlp, a, b in self.spans:  # an MLP's span comes before its layer's
            ms = a.elapsed_time(b)
            if mlp is not None:
                out[mlp] += ms
                mlp_ms = ms
            else:
                out[attn] += ms - mlp_ms
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def breakdown(engine, length: int, copy_gbps: float, seed: int) -> dict:
    """One cold prefill of `length` tokens with per-layer-type timing and floors. It runs eagerly: a replayed
    prefill graph calls no module, so the hooks would see nothing; the same length with the graphs is timed
    next to it (`graphed_ms`)."""
    model = engine.model
    V = engine.model_cfg.vocab_size
    std = getattr(engine.runner, "standard", engine.runner)  # the specialized runner's prefill is the standard's
    graphs = getattr(std, "prefill", None)
    std.prefill = None
    timer = None
    try:
        first_token_s(engine, random_prompt(length, V, seed + 1000))  # eager warm-up at this length (untimed)
        timer = LayerTimer(model)
        torch.cuda.synchronize()
        total = first_token_s(engine, random_prompt(length, V, seed)) * 1e3
        per = timer.totals_ms()
    finally:
        if timer is not None:
            timer.remove()
        std.prefill = graphs
    graphed = first_token_s(engine, random_prompt(length, V, seed + 1)) * 1e3 if graphs is not None else None
    per["other"] = max(0.0, total - sum(v for k, v in per.items() if k != "other"))
    budget = engine.scheduler.max_num_batched_tokens
    chunks = chunks_of(length, budget)
    # whether that second run's steps were graphed (a step above the largest bucket runs eagerly there too)
    served = graphs is not None and graphs.bucket(max(n for _, n in chunks)) is not None
    flops, wb = prefill_flops(engine.model_cfg, chunks), weight_bytes(model)
    rows = {}
    for k in TYPES:
        comp = flops[k] / (PEAK_TFLOPS * 1e12) * 1e3
        read = wb[k] * len(chunks) / (copy_gbps * 1e9) * 1e3
        floor = max(comp, read)
        rows[k] = {"ms": per[k], "tflop": flops[k] / 1e12, "compute_floor_ms": comp, "weight_read_floor_ms": read,
                   "pct_of_floor": 100 * floor / per[k] if per[k] > 0 else None}
    return {"length": length, "total_ms": total, "graphed_ms": graphed, "graphs_serve": served, "steps": len(chunks),
            "chunk_tokens": budget, "types": rows}


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(vocab) for _ in range(n)]


def run(model: str, lengths: list[int], runs: int = 3, dummy_weights: bool = True, breakdown_len: int | None = 32768,
        decode_tokens: int = 64, engine_overrides: dict | None = None, additional_config: str | None = None,
        log=print) -> dict:
    from ..config import EngineConfig
    from ..engine.build import build_engine, warm_cold_attention
    from .gpu import copy_bandwidth, run_metadata
    if not torch.cuda.is_available():
        breakdown_len = None  # CUDA events: the GPU only
    longest = max(lengths + ([breakdown_len] if breakdown_len else []))
    ecfg = EngineConfig(max_num_seqs=2, max_model_len=longest + TURN2_NEW_TOKENS + decode_tokens + 1, seed=0)
    if additional_config:
        ecfg.apply_additional_config(additional_config)
    for k, v in (engine_overrides or {}).items():
        setattr(ecfg, k, v)
    copy = copy_bandwidth() if torch.cuda.is_available() else {"gbps": float("nan")}
    log(f"copy bandwidth {copy['gbps']:.0f} GB/s (same run)")
    engine, _ = build_engine(model, ecfg, dummy_weights=dummy_weights, log=log)
    warm_cold_attention(engine, log)  # as a server's start-up does
    V = engine.model_cfg.vocab_size
    rows = []
    for L in lengths:
        log(f"TTFT at {L} tokens: warm-up")
        w = random_prompt(L, V, 10_000 + L)
        first_token_s(engine, w)
        first_token_s(engine, w + random_prompt(TURN2_NEW_TOKENS, V, 20_000 + L))
        cold, turn2, hit, gcs = [], [], [], []
        for r in range(runs):
            p = random_prompt(L, V, 1000 * r + L)
            with GCWatch() as w:
                cold.append(first_token_s(engine, p) * 1e3)
            gcs.append(w.summary())
            h0 = engine.prefix_cache.stats["hit_tokens"]
            turn2.append(first_token_s(engine, p + random_prompt(TURN2_NEW_TOKENS, V, 1000 * r + L + 1)) * 1e3)
            hit.append(engine.prefix_cache.stats["hit_tokens"] - h0)
        row = {"length": L, "cold_ms": statistics.median(cold), "turn2_ms": statistics.median(turn2),
               "cold_samples_ms": cold, "turn2_samples_ms": turn2, "turn2_reused_tokens": hit, "cold_gc": gcs}
        rows.append(row)
        log(f"TTFT at {L:6d} tokens: cold {row['cold_ms']:8.1f} ms, turn 2 (+{TURN2_NEW_TOKENS}) {row['turn2_ms']:7.1f} ms "
            f"(reused {hit} tokens); samples cold {[round(x, 1) for x in cold]}, turn 2 {[round(x, 1) for x in turn2]}; "
            f"garbage collections in the cold runs (generation: ms) {gcs}")
    payload = {"model": model, "meta": run_metadata(), "copy_bandwidth": copy, "runs": runs,
               "prefix_caching": ecfg.enable_prefix_caching, "max_num_batched_tokens": ecfg.max_num_batched_tokens,
               "rows": rows}
    if breakdown_len:
        log(f"per-layer-type breakdown of a cold {breakdown_len}-token prefill")
        first_token_s(engine, random_prompt(breakdown_len, V, 77))  # warm-up at this length
        payload["breakdown"] = breakdown(engine, breakdown_len, copy["gbps"], 78)
        b = payload["breakdown"]
        payload["user_turn"] = user_turn(engine, breakdown_len, b["graphed_ms"] or b["total_ms"], decode_tokens, V)
        log("a prefill chunk joining a decode step")
        payload["mixed_step"] = mixed_step_cost(engine, V)
    return payload


def mixed_step_cost(engine, vocab: int, reps: int = 3) -> dict:
    """What a running decode pays when a prompt's chunk is scheduled beside it: a decode-only step, a
    prefill-only step of one chunk, and the steps that carry the chunk with the decode (one mixed step
    on the standard path, or with prefill pieces one decode step per piece): the decode's longest wait
    for a token among them, their count and total, host-timed as the engine runs them (medians of `reps`)."""
    from ..engine import SamplingParams
    chunk = engine.scheduler.decode_budget
    dec, pre, mixed, nsteps, total = [], [], [], [], []
    for r in range(reps):
        engine.add_request(random_prompt(chunk, vocab, 500 + r), SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            if engine.last_step.num_prefill_tokens == chunk:
                pre.append(engine.last_step.duration_s * 1e3)
        rid = engine.add_request(random_prompt(1024, vocab, 600 + r), SamplingParams(max_tokens=10_000, ignore_eos=True))
        for _ in range(24):  # into steady decode
            engine.step()
        for _ in range(8):
            engine.step()
            dec.append(engine.last_step.duration_s * 1e3)
        done = []
        engine.add_request(random_prompt(chunk, vocab, 700 + r), SamplingParams(max_tokens=1, ignore_eos=True),
                           on_token=lambda o: done.append(o.finished))
        waits = []
        while not any(done) and len(waits) < 64:
            engine.step()
            if engine.last_step.num_decode_seqs == 1:
                waits.append(engine.last_step.duration_s * 1e3)
        mixed.append(max(waits))
        nsteps.append(len(waits))
        total.append(sum(waits))
        engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"chunk_tokens": chunk, "piece_layers": engine.piece_layers, "decode_ms": med(dec), "prefill_ms": med(pre),
            "mixed_ms": med(mixed), "steps_with_chunk": med(nsteps), "chunk_total_ms": med(total),
            "decode_samples_ms": dec, "prefill_samples_ms": pre, "mixed_samples_ms": mixed,
            "steps_with_chunk_samples": nsteps, "chunk_total_samples_ms": total,
            "fallback_cost_ms": med(total) - med(pre)}


def user_turn(engine, length: int, ttft_ms: float, n: int, vocab: int) -> dict:
    """Median ITL of `n` decode tokens after a `length`-token prompt, and TTFT + 500 × ITL."""
    from ..engine import SamplingParams
    stamps = []
    engine.add_request(random_prompt(length, vocab, 79), SamplingParams(max_tokens=n, ignore_eos=True),
                       on_token=lambda o: stamps.append(time.perf_counter()))
    while engine.has_unfinished():
        engine.step()
    itl = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    med = itl[len(itl) // 2] * 1e3 if itl else float("nan")
    return {"length": length, "itl_ms": med, "itl_samples_ms": [x * 1e3 for x in itl], "ttft_ms": ttft_ms,
            "turn_500_tokens_s": (ttft_ms + 500 * med) / 1e3}


def markdown(p: dict) -> str:
    out = [f"# Time to first token: {p['model']}", "",
           f"{p['meta']['gpu']}, commit `{p['meta']['commit']}`, torch {p['meta']['torch']}, triton {p['meta']['triton']}; "
           f"copy bandwidth {p['copy_bandwidth']['gbps']:.0f} GB/s; B = 1, {p['runs']} runs, medians; prefix caching "
           f"{'on' if p['prefix_caching'] else 'off'}; prefill chunks of {p['max_num_batched_tokens']} tokens", "",
           "| prompt tokens | cold TTFT ms | turn 2 (+64) TTFT ms | reused tokens |", "|---:|---:|---:|---|"]
    for r in p["rows"]:
        out.append(f"| {r['length']} | {r['cold_ms']:.1f} | {r['turn2_ms']:.1f} | {r['turn2_reused_tokens']} |")
    b = p.get("breakdown")
    if b:
        graphed = (f"; {b['graphed_ms']:.1f} ms " + ("with prefill graphs" if b.get("graphs_serve", True) else
                   "without the hooks (one sample; prefill graphs do not serve steps this long)")) if b.get("graphed_ms") else ""
        out += ["", f"Cold {b['length']}-token prefill ({b['steps']} steps of ≤ {b['chunk_tokens']} tokens), eager with "
                    f"CUDA events around every layer and its MLP: {b['total_ms']:.1f} ms{graphed}", "",
                "| layer type | ms | TFLOP | compute floor ms | weight-read floor ms | % of floor |",
                "|---|---:|---:|---:|---:|---:|"]
        for k, v in b["types"].items():
            pct = "" if v["pct_of_floor"] is None else f"{v['pct_of_floor']:.0f}"
            out.append(f"| {k} | {v['ms']:.1f} | {v['tflop']:.1f} | {v['compute_floor_ms']:.1f} | "
                       f"{v['weight_read_floor_ms']:.1f} | {pct} |")
    m = p.get("mixed_step")
    if m:
        how = (f"in prefill pieces of {m['piece_layers']} layers, a decode step between two"
               if m.get("piece_layers") else "in one mixed step on the standard path")
        out += ["", f"A {m['chunk_tokens']}-token prefill chunk scheduled beside one running decode, {how}: "
                    f"{m.get('steps_with_chunk', 1):.0f} steps, {m.get('chunk_total_ms', m['mixed_ms']):.1f} ms in all; "
                    f"the decode's longest wait for a token {m['mixed_ms']:.1f} ms (prefill alone {m['prefill_ms']:.1f} ms, "
                    f"decode alone {m['decode_ms']:.2f} ms)"]
    u = p.get("user_turn")
    if u:
        out += ["", f"A user's turn at {u['length']} tokens: TTFT {u['ttft_ms']:.0f} ms + 500 × ITL {u['itl_ms']:.2f} ms "
                    f"= {u['turn_500_tokens_s']:.2f} s"]
    return "\n".join(out) + "\n"


def add_bench_ttft_parser(subparsers) -> argparse.ArgumentParser:
    from .cli import int_list
    p = subparsers.add_parser("ttft", help="time to first token, cold and turn 2 (prefix reuse), per prompt length")
    p.add_argument("--model", required=True, help="preset name or model folder")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (no checkpoint needed)")
    p.add_argument("--lengths", type=int_list, default=[1024, 8192, 32768, 131072], help="prompt lengths (default 1K,8K,32K,128K)")
    p.add_argument("--runs", type=int, default=3, help="fresh prompts per length (default 3)")
    p.add_argument("--breakdown-len", type=int, default=32768, help="prompt length of the per-layer-type breakdown (0: none)")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed for the user-turn estimate")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="prefill chunk (default: the engine's)")
    p.add_argument("--no-enable-prefix-caching", action="store_true", help="turn 2 without reuse")
    p.add_argument("--additional-config", default=None, help="JSON object, as for serve")
    p.add_argument("--results-dir", default="results", help="where the JSON goes (default results)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args) -> int:
    from ..config import ConfigError
    from .gpu import result_path, write_result
    if args.runs < 1:
        raise ConfigError("--runs must be >= 1")
    log = lambda m: print(f"[bench ttft] {m}", file=sys.stderr, flush=True)  # noqa: E731
    over = {"enable_prefix_caching": not args.no_enable_prefix_caching}
    if args.max_num_batched_tokens:
        over["max_num_batched_tokens"] = args.max_num_batched_tokens
    p = run(args.model, args.lengths, args.runs, args.dummy_weights, args.breakdown_len or None, args.decode_tokens,
            over, args.additional_config, log)
    slug = p["model"].replace("/", "_")
    path = write_result(result_path(slug, "ttft" + ("" if p["prefix_caching"] else "-no-prefix-caching"), args.results_dir), p)
    path.with_suffix(".md").write_text(markdown(p))
    print(markdown(p))
    log(f"wrote {path}")
    return 0
