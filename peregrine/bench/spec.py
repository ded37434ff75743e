"""`peregrine bench spec`: speculative decoding against plain decoding, in one run over one engine.

Per batch size B, B requests with repetitive prompts (a random pattern repeated to input_len; greedy,
EOS ignored) run to completion: first plain (speculation off), then with each k of the sweep, then
(--oracle) with an oracle drafter that proposes the plain run's own output: the acceptance ceiling,
i.e. what the verify step costs when every draft is right. Only steps with exactly B sequences all in
decode count. Reported per configuration: median step time (all steps, and verify steps alone),
tokens per step per user, effective tok/s/user = tokens / B / time of those steps, speedup over plain,
acceptance (drafts, accepted, mean acceptance length), distinct routed experts per MoE layer per step
(verification routes B·(k+1) tokens: more experts read per step), and whether the greedy outputs
equal the plain ones. JSON (and a Markdown table) under results/.

--acceptance-lengths: per k, the same engine with synthetic acceptance at each mean acceptance length
(vLLM's rejection_sample_method "synthetic": every row drafts its whole room (ids that route like text) and accepts a drawn
count; outputs are not the model's), once per --widths mode: "auto" (the verify width chosen per step
from the costs timed at enable, GPU graphs only: elsewhere it verifies every draft) and "full" (every
draft, the seed's "DL7" protocol). Reported beside the rest: rows verified per request a step and the
widths chosen. --temperature (with --top-p, --top-k, --min-p): plain and every synthetic configuration are
measured once more with sampled rows (rejection sampling, each row's draws keyed by its seed and position),
right after the greedy one on the same engine; a sampled configuration's speedup is over plain sampled, and
its "vs_greedy_speedup" the ratio of the two speedups.
"""
from __future__ import annotations

import argparse
import gc
import random
import traceback

import torch

from ..config import ConfigError, EngineConfig, resolve_model
from ..speculative.config import SpeculativeConfig, acceptance_rates_for
from .cli import int_list, positive_list, sampling_settings
from .decode import run_batch

PROMPT_SEED = 4321       # prompt set s uses PROMPT_SEED + s: the same prompts for every configuration
ROUTING_TOKENS = 64      # tokens of the untimed run that counts routed experts


def repetitive_prompts(vocab: int, batch: int, input_len: int, pattern_len: int, set_idx: int) -> list[list[int]]:
    rng = random.Random(PROMPT_SEED + set_idx)
    hi = min(vocab, 256) if vocab > 256 else vocab  # byte-range ids: fine for every tokenizer
    out = []
    for _ in range(batch):
        pat = [rng.randrange(hi) for _ in range(pattern_len)]
        out.append((pat * (input_len // pattern_len + 1))[:input_len])
    return out


class OracleDrafter:
    """Proposes the reference (plain greedy) continuation while the sequence still follows it."""

    def __init__(self, refs: dict[tuple, list[int]]):
        self.refs = refs

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            ref, gen = self.refs.get(tuple(s.token_ids[: s.prompt_len]), []), s.token_ids[s.prompt_len:]
            out.append(ref[len(gen): len(gen) + k] if ref[: len(gen)] == gen else [])
        return out

    def verified(self, seq, drafted, accepted):
        pass

    def release(self, seq):
        pass


def run(engine, prompts, params) -> tuple[list[dict], list[list[int]]]:
    """Add the prompts together, step to completion; per-step records and the outputs."""
    outs: list[list[int]] = []
    return run_batch(engine, prompts, params, outs), outs


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _routing(engine, prompts, params, B) -> dict:
    """Mean distinct experts per MoE layer, over pure-decode plain and verify steps (one untimed eager run)."""
    r = engine.runner
    if not hasattr(r, "routed_experts_per_step"):
        return {}
    n0 = len(r.routed_experts_per_step())
    r.record_routing = True
    try:
        recs, _ = run(engine, prompts, params)
    finally:
        r.record_routing = False
    ent = list(r.routed_experts_per_step())[n0:]
    if len(ent) != len(recs):
        return {"note": f"{len(ent)} routing entries for {len(recs)} steps: not aligned"}
    out = {}
    for kind, pick in (("plain_steps", lambda x: not x["drafted"]), ("verify_steps", lambda x: x["drafted"] > 0)):
        rows = [e for e, x in zip(ent, recs) if _pure(x, B) and pick(x) and e]
        if rows:
            out[kind] = sum(sum(e) / len(e) for e in rows) / len(rows)
    return out


def _pure(rec, B) -> bool:
    return rec["num_seqs"] == B and rec["num_prefill_tokens"] == 0 and rec["num_decode_seqs"] == B


def _measure(engine, B, prompt_sets, params, runs, refs, log, label) -> dict:
    recs, equal, total = [], 0, 0
    run(engine, prompt_sets[0], params)  # warm-up: compiles, captures, allocator
    for ps in prompt_sets:
        for _ in range(runs):
            r, outs = run(engine, ps, params)
            recs += [x for x in r if _pure(x, B)]
            for p, o in zip(ps, outs):
                total += 1
                if refs is not None:
                    equal += o == refs[tuple(p)]
    if not recs:
        raise RuntimeError(f"no step ran with exactly {B} sequences all in decode")
    dur = sum(x["duration_s"] for x in recs)
    new = sum(x["new"] for x in recs)
    drafted, accepted = sum(x["drafted"] for x in recs), sum(x["accepted"] for x in recs)
    ver = [x["duration_s"] * 1e3 for x in recs if x["drafted"]]
    out = {"label": label, "steps": len(recs), "median_step_ms": _median([x["duration_s"] * 1e3 for x in recs]),
           "mean_step_ms": dur * 1e3 / len(recs), "median_verify_step_ms": _median(ver), "verify_steps": len(ver),
           "tokens_per_step_per_user": new / len(recs) / B, "effective_tok_s_user": new / B / dur,
           "draft_tokens": drafted, "accepted_tokens": accepted,
           "rows_per_request": 1 + drafted / B / len(ver) if ver else 1.0,  # per verify step: own token + drafts
           "acceptance_rate": accepted / drafted if drafted else None,
           "paths": dict(sorted({x["path"]: 0 for x in recs}.items()))}
    for x in recs:
        out["paths"][x["path"]] += 1
    if refs is not None:
        out["outputs_equal_plain"] = f"{equal}/{total}"
    log(f"  {label:>14} B={B}: median step {out['median_step_ms']:.3f} ms, {out['tokens_per_step_per_user']:.2f} tok/step/user, "
        f"{out['effective_tok_s_user']:.1f} tok/s/user" + (f", accepted {accepted}/{drafted}" if drafted else "")
        + (f", outputs equal plain {out['outputs_equal_plain']}" if refs is not None else ""))
    return out


def _synthetic(engine, drafter, B, k, lengths, widths, sets, modes, runs, rparams, log) -> list[dict]:
    """The synthetic-acceptance configurations of one B and k (the engine's speculation enabled at k), each once
    per mode: [(label suffix, SamplingParams, that mode's plain results by B)], greedy first."""
    out, sp = [], engine.spec
    for L in lengths:
        if not 1 <= L <= k + 1:
            continue
        for mode in widths:
            greedy_speedup = None
            for suffix, params, plain in modes:
                label = f"synthetic {L:g} k={k} {mode}{suffix}"
                sp.drafter, sp.rates, sp.width_mode = drafter, acceptance_rates_for(L, k), mode
                sp.stats["synthetic_acceptance_length"] = L
                w0 = list(sp.stats["width_steps"])
                try:
                    c = _measure(engine, B, sets[B], params, runs, None, log, label)
                    c.update(k=k, acceptance_length=L, width=mode, sampled=not params.greedy,
                             speedup_vs_plain=c["effective_tok_s_user"] / plain[B]["effective_tok_s_user"],
                             width_steps=[a - b for a, b in zip(sp.stats["width_steps"], w0)])
                    v = c["median_verify_step_ms"]
                    c["verify_vs_plain_step"] = v / plain[B]["median_step_ms"] if v else None
                    if params.greedy:
                        greedy_speedup = c["speedup_vs_plain"]
                        c["routing"] = _routing(engine, sets[B][0], rparams, B)
                    elif greedy_speedup:
                        c["vs_greedy_speedup"] = c["speedup_vs_plain"] / greedy_speedup
                except Exception as e:  # a failing configuration is reported, the sweep goes on
                    log(f"WARNING: {label} B={B} failed: {e!r}")
                    c = {"label": label, "k": k, "status": "error", "reason": repr(e),
                         "traceback": traceback.format_exc()}
                out.append(c)
    sp.rates, sp.width_mode = None, "auto"
    sp.stats.pop("synthetic_acceptance_length", None)
    return out


def bench_replay(model: str, methods=("ngram", "suffix"), k: int = 7, sessions: int = 2, turns: int = 3,
                 context_chars: int = 120_000, backend: str = "latency_specialized", dummy_weights: bool = False,
                 results_dir: str | None = "results", log=print, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Replay (speculative/replay.py): agent-shaped sessions at B = 1 with every reply forced, plain decode and then each
    drafter method at k on the same engine; tok/s/user after the first token and acceptance, per turn. temperature
    > 0: the requests sample (the forced token still wins), so a sampled request's own path is what is timed."""
    from ..engine.build import build_engine
    from ..speculative.replay import agent_sessions, replay, replay_encoder
    from . import gpu
    cfg, _ = resolve_model(model)
    sess = agent_sessions(sessions, turns, max_chars=context_chars)
    engine, tok = build_engine(model, EngineConfig(max_num_seqs=1, decode_backend=backend,
                                                   max_model_len=min(cfg.max_position_embeddings, 65536)),
                               dummy_weights=dummy_weights, log=log)
    enc = replay_encoder(tok, cfg.vocab_size)
    longest = max(len(enc.encode(c + r)) for p in sess for c, r in p)
    if longest + k + 2 > engine.max_model_len:
        raise ConfigError(f"replay sessions reach {longest} tokens, past max_model_len {engine.max_model_len}: "
                          f"lower --replay-context")
    result = {"kind": "spec_replay", "model": cfg.name, "metadata": gpu.run_metadata(),
              "config": {"methods": list(methods), "k": k, "sessions": sessions, "turns": turns,
                         "context_chars": context_chars, "backend": backend, "dummy_weights": dummy_weights,
                         "temperature": temperature, "top_p": top_p,
                         "tokens": enc.kind},
              "copy_bandwidth": gpu.copy_bandwidth() if torch.cuda.is_available() else None, "runs": []}
    path = gpu.result_path(cfg.name, f"spec-replay-{backend}", results_dir) if results_dir is not None else None

    def save():  # after every method: a run cut short by a time limit still leaves what it measured
        if path is not None:
            gpu.write_result(path, result)

    engine.enable_speculation(None)
    sampling = {"temperature": temperature, "top_p": top_p}
    result["runs"].append(replay(engine, sess, enc.encode, "plain", log, sampling))
    save()
    for m in methods:
        engine.enable_speculation({"method": m, "num_speculative_tokens": k}, log=log)
        r = {"cost_table_ms": engine.spec.measure_costs(log)}  # the width chooser's (empty off the GPU: full width)
        r |= replay(engine, sess, enc.encode, m, log, sampling)
        base = result["runs"][0]
        r["speedup_vs_plain"] = r["tok_s_user"] / base["tok_s_user"] if base["tok_s_user"] and r["tok_s_user"] else None
        for t, p in zip(r["turns"], base["turns"]):  # the same turn, plain: the target is per turn
            t["speedup_vs_plain"] = t["tok_s_user"] / p["tok_s_user"] if t["tok_s_user"] and p["tok_s_user"] else None
        sp = [t["speedup_vs_plain"] for t in r["turns"] if t["speedup_vs_plain"]]
        if sp:
            log(f"  replay {m:>10}: per turn {min(sp):.2f}x .. {max(sp):.2f}x plain")
        result["runs"].append(r)
        save()
    engine.enable_speculation(None)
    table = next((r["cost_table_ms"].get(1) for r in result["runs"] if r.get("cost_table_ms")), None)
    for r in result["runs"]:  # what the steps took beyond their graphs' times: host work, or a table that is off
        r["excess_ms_per_step"] = _excess_per_step(r, table)
        if r["excess_ms_per_step"] is not None:
            log(f"  replay {r['label']:>10}: {r['excess_ms_per_step']:.3f} ms a decode step over the cost table")
    if path is not None:
        save()
        result["paths"] = {"json": str(path)}
        log(f"wrote {path}")
    return result


def _excess_per_step(run: dict, table: dict | None) -> float | None:
    """(decode seconds - each decode step's table time) / decode steps, over a replay run's turns, at B = 1: plain
    steps are its tokens after the first; a speculative run's are its width_steps (the table's T = 1 + width)."""
    if not table:
        return None
    steps = ms = 0.0
    for t in run["turns"]:
        ws = t.get("width_steps") or [t["output_tokens"] - 1]
        if not any(ws):  # a speculative run with no decisions recorded (no table when it ran)
            return None
        steps += sum(ws)
        ms += sum(n * table[w + 1] for w, n in enumerate(ws) if n)
    dec = sum(t["decode_s"] for t in run["turns"]) * 1e3
    return (dec - ms) / steps if steps else None


def bench_spec(model: str, batch_sizes=(1, 2, 4), ks=(3,), spec_config=None, input_len: int = 256,
               output_len: int = 128, pattern_len: int = 16, prompt_sets: int = 1, runs: int = 2,
               backend: str = "latency_specialized", dummy_weights: bool = False, oracle: bool = True,
               results_dir: str | None = "results", builder=None, log=print, acceptance_lengths=(),
               widths=("auto", "full"), sampling: dict | None = None) -> dict:
    from ..engine.request import SamplingParams
    from . import gpu
    base = SpeculativeConfig.parse(spec_config or {"method": "ngram", "num_speculative_tokens": max(ks)})
    cfg, _ = resolve_model(model)
    ecfg = EngineConfig(max_num_seqs=max(batch_sizes), max_decode_batch=min(16, max(batch_sizes)), decode_backend=backend,
                        max_model_len=input_len + output_len + max(ks) + 2)
    if builder is None:
        from ..engine.build import build_engine as builder
    engine, _ = builder(model, ecfg, dummy_weights=dummy_weights, log=log)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rparams = SamplingParams(temperature=0.0, max_tokens=min(output_len, ROUTING_TOKENS), ignore_eos=True)
    sparams = SamplingParams(max_tokens=output_len, ignore_eos=True, **sampling) if sampling else None
    copy = gpu.copy_bandwidth() if torch.cuda.is_available() else None  # the same run's floor, beside its figures
    result = {"kind": "spec_decode", "model": cfg.name, "metadata": gpu.run_metadata(), "copy_bandwidth": copy,
              "config": {"batch_sizes": list(batch_sizes), "ks": list(ks), "spec_config": vars(base), "input_len": input_len,
                         "output_len": output_len, "pattern_len": pattern_len, "prompt_sets": prompt_sets, "runs": runs,
                         "backend": backend, "dummy_weights": dummy_weights, "oracle": oracle,
                         "acceptance_lengths": list(acceptance_lengths), "widths": list(widths),
                         "sampling": sampling or None},
              "batches": []}
    try:
        sets, refs, plain, plain_sampled = {}, {}, {}, {}
        engine.enable_speculation(None)
        for B in batch_sizes:  # plain first: the reference outputs and the baseline of every B
            sets[B] = [repetitive_prompts(cfg.vocab_size, B, input_len, pattern_len, s) for s in range(prompt_sets)]
            for ps in sets[B]:
                _, outs = run(engine, ps, params)
                refs.update({tuple(p): o for p, o in zip(ps, outs)})
            plain[B] = _measure(engine, B, sets[B], params, runs, None, log, "plain")
            plain[B]["routing"] = _routing(engine, sets[B][0], rparams, B)
            result["batches"].append({"batch": B, "configs": [plain[B]]})
            if sparams is not None:
                plain_sampled[B] = _measure(engine, B, sets[B], sparams, runs, None, log, "plain sampled")
                plain_sampled[B]["sampled"] = True
                result["batches"][-1]["configs"].append(plain_sampled[B])
        modes = [("", params, plain)] + ([(" sampled", sparams, plain_sampled)] if sparams is not None else [])
        for k in ks:  # one enable per k: the verify graphs (B, T = 2 .. k+1) are captured once
            try:
                engine.enable_speculation(SpeculativeConfig(**dict(vars(base), num_speculative_tokens=k)), log=log)
            except Exception as e:
                log(f"WARNING: speculation with k={k} could not be enabled: {e!r}")
                for entry in result["batches"]:
                    entry["configs"].append({"label": f"{base.method} k={k}", "k": k, "status": "error", "reason": repr(e)})
                continue
            own = engine.spec.drafter
            if acceptance_lengths:
                engine.spec.measure_costs(log)  # the width chooser's table (empty without graphs: full width)
            drafters = [(f"{base.method} k={k}", own)] + ([(f"oracle k={k}", OracleDrafter(refs))] if oracle else [])
            for entry in result["batches"]:
                B = entry["batch"]
                for label, drafter in drafters:
                    engine.spec.drafter = drafter
                    try:
                        c = _measure(engine, B, sets[B], params, runs, refs, log, label)
                        c["k"] = k
                        c["speedup_vs_plain"] = c["effective_tok_s_user"] / plain[B]["effective_tok_s_user"]
                        v = c["median_verify_step_ms"]
                        c["verify_vs_plain_step"] = v / plain[B]["median_step_ms"] if v else None
                        c["routing"] = _routing(engine, sets[B][0], rparams, B)
                        rt = getattr(engine.runner, "graph_replay_time", None)
                        if torch.cuda.is_available() and rt is not None:
                            try:
                                c["graph_replay_ms"] = {f"T={T}": rt(B, 50, T=T) for T in (1, k + 1)}
                            except TypeError:  # a runner without verify graphs (standard)
                                pass
                    except Exception as e:  # a failing configuration is reported, the sweep goes on
                        log(f"WARNING: {label} B={B} failed: {e!r}")
                        c = {"label": label, "k": k, "status": "error", "reason": repr(e), "traceback": traceback.format_exc()}
                    entry["configs"].append(c)
                entry["configs"] += _synthetic(engine, own, B, k, acceptance_lengths, widths, sets, modes, runs, rparams,
                                               log)
            engine.enable_speculation(None)
    finally:
        result["engine_stats"] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in engine.stats.items()}
        del engine
        gc.collect()
    if results_dir is not None:
        path = gpu.write_result(gpu.result_path(cfg.name, f"spec-{backend}", results_dir), result)
        md = path.with_suffix(".md")
        md.write_text(markdown(result))
        result["paths"] = {"json": str(path), "md": str(md)}
        log(f"wrote {path} and {md}")
    return result


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"**{result['model']}** speculative decoding, backend {c['backend']}, input {c['input_len']} "
             f"(pattern {c['pattern_len']}), output {c['output_len']}", "",
             "| B | config | median step ms | verify step ms | tok/step/user | eff. tok/s/user | speedup | accepted/drafted "
             "| rows/request | experts/layer (plain → verify) | = plain |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    for b in result["batches"]:
        for x in b["configs"]:
            if x.get("status") == "error":
                lines.append(f"| {b['batch']} | {x['label']} | error: {x['reason'][:60]} | | | | | | | | |")
                continue
            rt = x.get("routing") or {}
            ex = " → ".join(f"{rt[k]:.1f}" for k in ("plain_steps", "verify_steps") if k in rt)
            lines.append(f"| {b['batch']} | {x['label']} | {f(x['median_step_ms'], '.3f')} | {f(x['median_verify_step_ms'], '.3f')} "
                         f"| {x['tokens_per_step_per_user']:.2f} | {x['effective_tok_s_user']:.1f} "
                         f"| {f(x.get('speedup_vs_plain'), '.2f')} | {x['accepted_tokens']}/{x['draft_tokens']} "
                         f"| {f(x.get('rows_per_request'), '.2f')} | {ex} "
                         f"| {x.get('outputs_equal_plain', '')} |")
    return "\n".join(lines) + "\n"


_int_list = int_list
_float_list = positive_list(float, "acceptance lengths (the bonus token counts)")


def add_bench_spec_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("spec", help="speculative vs plain decoding: step time, accepted tokens, tok/s/user")
    p.add_argument("--model", required=True, help="preset name or model folder")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (no checkpoint needed)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4], help="B values, e.g. 1,2,4 (default)")
    p.add_argument("--k", type=_int_list, default=[3], help="num_speculative_tokens values to sweep, e.g. 2,4")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='drafter settings (default {"method": "ngram"}); its num_speculative_tokens is replaced by --k')
    p.add_argument("--backend", choices=["standard", "latency_specialized"], default="latency_specialized", help="decode path (default latency_specialized)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--pattern-len", type=int, default=16, help="the prompt repeats a random pattern of this many tokens")
    p.add_argument("--prompt-sets", type=int, default=1, help="different prompt sets per B (default 1)")
    p.add_argument("--runs", type=int, default=2, help="runs per prompt set (default 2)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle drafter (acceptance ceiling)")
    p.add_argument("--acceptance-lengths", type=_float_list, default=[], metavar="L,...",
                   help="synthetic acceptance at these mean lengths (the bonus token counted), e.g. 2.33,3,3.78,4.73,6; "
                        "benchmark only: drafts are accepted by chance")
    p.add_argument("--widths", default="auto,full", help="verify width modes for the synthetic runs: auto (chosen per "
                   "step from measured costs), full (every draft); default both")
    p.add_argument("--replay-sessions", type=int, default=0, metavar="N",
                   help="instead of the sweep: N agent-shaped sessions replayed at B = 1 with every reply forced "
                        "(drafters' acceptance on real text, the engine's real cost); methods from --replay-methods")
    p.add_argument("--replay-turns", type=int, default=3, help="turns per replayed session (default 3)")
    p.add_argument("--replay-context", type=int, default=120_000, help="characters of files a session adds in all")
    p.add_argument("--replay-methods", default="ngram,suffix", help="drafter methods to replay (default ngram,suffix)")
    p.add_argument("--replay-temperature", type=float, default=0.0,
                   help="replayed requests sample at this temperature (default 0: greedy); the recorded token still wins")
    p.add_argument("--replay-top-p", type=float, default=1.0, help="their top_p (default 1)")
    p.add_argument("--results-dir", default="results", help="where the JSON goes (default results)")
    g = p.add_argument_group("sampled rows: plain and each synthetic configuration measured greedy, then sampled")
    g.add_argument("--temperature", type=float, default=None, help="> 0: sampled rows at this temperature")
    g.add_argument("--top-p", type=float, default=None, help="their nucleus mass (default off)")
    g.add_argument("--top-k", type=int, default=None, help="their top-k (default off)")
    g.add_argument("--min-p", type=float, default=None, help="their min-p (default off)")
    p.set_defaults(func=run_bench_spec)
    return p


def run_bench_spec(args) -> int:
    import json
    import sys
    try:
        sc = json.loads(args.speculative_config) if args.speculative_config else None
        if sc is not None:
            sc = dict(sc, num_speculative_tokens=max(args.k))
        for name in ("input_len", "output_len", "pattern_len", "prompt_sets", "runs"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if args.replay_sessions > 0:
            methods = [m.strip() for m in args.replay_methods.split(",") if m.strip()]
            if any(m not in ("ngram", "suffix") for m in methods) or args.replay_turns < 1:
                raise ConfigError("--replay-methods takes ngram and/or suffix; --replay-turns must be >= 1")
            if args.replay_temperature < 0 or not 0 < args.replay_top_p <= 1:
                raise ConfigError("--replay-temperature must be >= 0 and --replay-top-p in (0, 1]")
            r = bench_replay(args.model, methods, max(args.k), args.replay_sessions, args.replay_turns,
                             args.replay_context, args.backend, args.dummy_weights, args.results_dir,
                             log=lambda m: print(f"[peregrine] {m}", file=sys.stderr, flush=True),
                             temperature=args.replay_temperature, top_p=args.replay_top_p)
            for run_ in r["runs"]:
                print(f"{run_['label']:>8}: {run_['tok_s_user'] or 0:.1f} tok/s/user"
                      + (f", acceptance length {run_['acceptance_length']:.2f}" if run_["acceptance_length"] else "")
                      + (f", {run_['speedup_vs_plain']:.2f}x plain" if run_.get("speedup_vs_plain") else ""))
            return 0
        try:
            sampling = sampling_settings(args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        widths = [w.strip() for w in args.widths.split(",") if w.strip()]
        if not widths or any(w not in ("auto", "full") for w in widths):
            raise ConfigError(f"--widths takes auto and/or full, got {args.widths!r}")
        r = bench_spec(args.model, args.batch_sizes, args.k, sc, args.input_len, args.output_len, args.pattern_len,
                       args.prompt_sets, args.runs, args.backend, args.dummy_weights, not args.no_oracle, args.results_dir,
                       log=lambda m: print(f"[peregrine] {m}", file=sys.stderr, flush=True),
                       acceptance_lengths=args.acceptance_lengths, widths=widths, sampling=sampling)
    except json.JSONDecodeError as e:
        print(f"error: --speculative-config is not valid JSON: {e.msg}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(r))
    return 1 if any(x.get("status") == "error" for b in r["batches"] for x in b["configs"]) else 0
