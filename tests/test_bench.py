"""Benchmark harness logic: step selection, percentiles, roofline bytes, plan, report, CLI.

Expected byte counts are written out by hand from the preset numbers (docs/models.md
shapes), never by calling roofline internals.
"""
import argparse
import json

import numpy as np
import pytest
import torch

from peregrine.bench import cli, decode, plan, report, roofline, stats
from peregrine.config import ConfigError, resolve_model

pytestmark = pytest.mark.gpu  # also runs in the GPU pass (the decode e2e then times for real)


# ---------------------------------------------------------------- stats
def test_decode_steps_keep_only_pure_decode_at_B():
    recs = [
        {"num_seqs": 2, "num_prefill_tokens": 2, "duration_s": 9.0},    # prefill of both
        {"num_seqs": 2, "num_prefill_tokens": 0, "duration_s": 1.0},
        {"num_seqs": 3, "num_prefill_tokens": 1, "duration_s": 8.0},    # a third request's prefill joins
        {"num_seqs": 3, "num_prefill_tokens": 0, "duration_s": 7.0},    # 3 running: not B = 2
        {"num_seqs": 2, "num_prefill_tokens": 0, "duration_s": 2.0, "num_decode_seqs": 2},
        {"num_seqs": 2, "num_prefill_tokens": 0, "duration_s": 6.0, "num_decode_seqs": 1},  # inconsistent: dropped
        {"num_seqs": 1, "num_prefill_tokens": 0, "duration_s": 5.0},    # tail with 1 left
    ]

    class Obj:  # objects (StepInfo-like) work as well as dicts
        num_seqs, num_prefill_tokens, num_decode_seqs, duration_s = 2, 0, 2, 3.0
    assert stats.decode_steps(recs + [Obj()], 2) == [1.0, 2.0, 3.0]
    assert stats.decode_steps(recs, 1) == [5.0]
    assert stats.decode_steps(recs, 4) == []


def test_percentiles_hand_computed():
    s = stats.summarize([4.0, 1.0, 3.0, 2.0])
    # sorted 1,2,3,4: position q/100*(n-1); p90 -> 2.7 -> 3 + 0.7*(4-3)
    assert s["median"] == s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7)
    assert s["p99"] == pytest.approx(3.97)
    assert s["mean"] == 2.5 and s["n"] == 4 and s["min"] == 1.0 and s["max"] == 4.0
    one = stats.summarize([7.0])
    assert one["p50"] == one["p90"] == one["p99"] == 7.0
    assert stats.summarize([])["n"] == 0 and stats.summarize([])["median"] is None
    xs = list(np.random.default_rng(0).exponential(size=101))
    for q in (10, 50, 90, 99):
        assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    with pytest.raises(ValueError):
        stats.percentile([], 50)


# ---------------------------------------------------------------- roofline, tiny preset by hand
# tiny-kimi-linear: D 256, 5 layers (KDA 1,2,4; MLA 3,5 1-based), vocab 320, KDA 4 heads x 64,
# conv 4, MLA 4 heads, kv_lora 128 + rope 32, nope 64, v 64, dense inter 512 (layer 0),
# 4 MoE layers: 16 experts top-4, inter 128, 1 shared. BF16 = 2 bytes.
D, V = 256, 320
KDA_LAYER = (3 * 256 * D            # q, k, v
             + 64 * D + 256 * 64    # f_a, f_b (rank = head_dim 64)
             + 4 * D                # b
             + 64 * D + 256 * 64    # g_a, g_b
             + D * 256              # o_proj
             + 3 * 256 * 4          # conv
             + 4 + 256)             # A_log, dt_bias
MLA_LAYER = 4 * 96 * D + 160 * D + 4 * 128 * 128 + D * 256  # q_proj, kv_a, kv_b, o_proj
DENSE = 3 * 512 * D
MOE_LAYER = 16 * D + 16 + 3 * 128 * D                    # router + bias, shared expert
NORMS = 5 * 2 * D + D + 3 * 64 + 2 * 128                 # layer norms, final, KDA o_norm, kv_a_layernorm
EXPERT_BYTES = 3 * 128 * D * 2
NON_ROUTED_NO_EMB = 2 * (3 * KDA_LAYER + 2 * MLA_LAYER + DENSE + 4 * MOE_LAYER + NORMS + V * D)


def tiny():
    return resolve_model("tiny-kimi-linear")[0]


def test_roofline_tiny_weights_by_hand():
    cfg = tiny()
    assert KDA_LAYER == 332036 and MLA_LAYER == 270336  # the hand sums themselves
    assert roofline.expert_bytes(cfg) == EXPERT_BYTES
    assert roofline.non_routed_step_bytes(cfg, 3) == NON_ROUTED_NO_EMB + 3 * D * 2
    total = NON_ROUTED_NO_EMB + 2 * V * D + 4 * 16 * EXPERT_BYTES
    assert roofline.total_weight_bytes(cfg) == total
    assert roofline.total_params(cfg) == total / 2


@pytest.mark.parametrize("kv,tok_bytes", [("auto", 160 * 2), ("bf16", 160 * 2), ("fp8", 160 + 4)])
def test_roofline_tiny_step_bytes_by_hand(kv, tok_bytes):
    cfg = tiny()
    B, ctx, distinct = 2, 10, [3, 4, 2, 5]
    expect = (NON_ROUTED_NO_EMB + B * D * 2
              + 14 * EXPERT_BYTES                    # distinct experts routed, summed over MoE layers
              + B * ctx * tok_bytes * 2              # latent reads, 2 MLA layers
              + B * tok_bytes * 2                    # latent writes
              + B * 3 * 4 * 64 * 64 * 4 * 2          # KDA state FP32 read + write, 3 KDA layers
              + B * 3 * 3 * (3 * 256) * 2 * 2        # conv state (3 taps x q|k|v) BF16 read + write
              + B * V * 4)                           # FP32 logits
    assert roofline.step_bytes(cfg, B, distinct, ctx, kv) == expect
    # a scalar count means the same count in every MoE layer
    assert roofline.step_bytes(cfg, B, 3.5, ctx, kv) == expect  # 3.5 x 4 MoE layers = 14
    with pytest.raises(ValueError):
        roofline.step_bytes(cfg, B, [1, 2], ctx, kv)


def test_expected_distinct():
    assert roofline.expected_distinct(256, 8, 1) == pytest.approx(8)
    assert [round(roofline.expected_distinct(256, 8, b), 1) for b in (2, 4, 8)] == [15.8, 30.5, 57.4]  # docs/models.md


# ---------------------------------------------------------------- plan vs docs/models.md
def test_plan_kimi_linear_matches_models_md():
    cfg = resolve_model("kimi-linear-48b-a3b")[0]
    p = plan.plan(cfg, context=1, measured_gbps=4260)
    wb = p["weight_bytes_by_category"]
    assert wb["lm_head"] == pytest.approx(0.75e9, rel=0.02)
    assert p["expert_bytes"] == pytest.approx(14.2e6, rel=0.01)
    assert p["params"] == pytest.approx(48e9, rel=0.04)
    assert p["weight_bytes_total"] == pytest.approx(97e9, rel=0.03)
    assert roofline.non_routed_step_bytes(cfg, 1) == pytest.approx(3.2e9, rel=0.03)
    st = {s["batch"]: s for s in p["steps"]}
    assert st[1]["bytes_short"] == pytest.approx(6.3e9, rel=0.03)
    for B, ms in {1: 1.5, 2: 2.2, 4: 3.5, 8: 6.0}.items():
        assert st[B]["floor_ms_measured"] == pytest.approx(ms, rel=0.05)
    assert p["fits_h200"] and p["max_seqs_at_context"] > 0
    assert [s["batch"] for s in p["steps"]] == list(range(1, 17))
    txt = plan.format_plan(p)
    assert "| 16 |" in txt and "4260" in txt


def test_plan_k3_tp():
    cfg = resolve_model("kimi-k3")[0]
    p8, p16 = plan.plan(cfg, tp=8, kv_cache_dtype="fp8"), plan.plan(cfg, tp=16)
    assert p8["expert_bytes"] == 3 * 3072 * 3584 * (0.5 + 1 / 32)  # MXFP4: half a byte a weight + a scale per 32
    assert p8["params"] == pytest.approx(2.8e12, rel=0.05)
    assert p16["weight_bytes_per_rank"] < p8["weight_bytes_per_rank"] < p8["weight_bytes_total"]
    assert not p8["fits_h200"] and p16["fits_h200"]  # ~1.56 TB of weights: 8 H200s are not enough
    assert p8["cache_bytes_per_seq"]["mla_latent"] == 8192 * (576 + 4) * 24
    s1 = p16["steps"][0]
    assert s1["distinct_experts_per_layer"] == pytest.approx(16) and s1["floor_ms_spec"] > 0
    assert "kimi-k3" in plan.format_plan(p16)
    with pytest.raises(ConfigError):
        plan.plan(cfg, tp=0)
    with pytest.raises(ConfigError):
        plan.plan(cfg, kv_cache_dtype="int4")


# ---------------------------------------------------------------- report
def synthetic_result(gbps=4000.0):
    def b(B, ms):
        return {"batch": B, "samples_ms": [ms] * 3, "median_ms": ms, "p90_ms": ms * 1.1, "tok_s_user": 1e3 / ms,
                "graph_replay_ms": ms * 0.98, "agreement_pct": 2.04, "distinct_experts_mean": 8.0 * B,
                "bytes_per_step": 6.3e9 * B ** 0.5, "achieved_gbps": 6.3 * B ** 0.5 / ms * 1e3,
                "pct_copy_bw": 6.3 * B ** 0.5 / ms * 1e3 / gbps * 100}
    return {"kind": "decode", "model": "kimi-linear-48b-a3b",
            "metadata": {"gpu": "NVIDIA H200", "commit": "abc123", "torch": "2.11", "triton": "3.6.0"},
            "config": {"input_len": 1, "output_len": 1024, "prompt_sets": 4, "runs": 3},
            "copy_bandwidth": {"gbps": gbps},
            "backends": {"standard": {"status": "ok", "batches": [b(1, 3.0), b(2, 4.0), b(4, 5.5)]},
                         "latency_specialized": {"status": "not available", "reason": "lands with issue 5"}},
            "ratios": {}}


def test_report_png_table_readme(tmp_path):
    f = tmp_path / "2026-01-01-h200-kimi-linear-48b-a3b-decode.json"
    f.write_text(json.dumps(synthetic_result()))
    (tmp_path / "other.json").write_text(json.dumps({"kind": "serve"}))  # ignored
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nintro\n<!-- perf-table:start -->\nold\n<!-- perf-table:end -->\ntail\n")
    out = report.report([f, tmp_path / "other.json"], out=tmp_path / "decode.png", readme=readme, log=lambda *a: None)
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    t = out["table"]
    assert "| standard | 2 | 4.000 |" in t and "not available: lands with issue 5" in t and "4000 GB/s" in t
    txt = readme.read_text()
    assert "old" not in txt and "| standard | 4 |" in txt and txt.endswith("tail\n") and txt.startswith("# x")
    fresh = tmp_path / "R2.md"  # no markers yet: a marked section is appended
    report.update_readme(fresh, "T")
    assert report.PERF_START in fresh.read_text() and "T" in fresh.read_text()
    with pytest.raises(ValueError):
        report.report([], results_dir=tmp_path / "none", log=lambda *a: None)


def tp_result(tp: int, ms: dict, model="kimi-linear-48b-a3b") -> dict:
    """A decode result at tensor-parallel size tp; ms: {backend: {B: median ms}}."""
    return {"kind": "decode", "model": model, "tensor_parallel_size": tp, "backends": {
        b: {"status": "ok", "batches": [{"batch": B, "median_ms": v} for B, v in per.items()]} for b, per in ms.items()}}


def test_tp_plot_step_time_against_tp(tmp_path, capsys):
    from peregrine.bench import tp_plot
    d = tmp_path / "results"
    d.mkdir()
    for tp, name in ((1, ""), (2, "-tp2"), (4, "-tp4"), (8, "-tp8")):
        ms = {"standard": {1: 9.0 / tp, 8: 18.0 / tp}, "latency_specialized": {1: 3.0 / tp ** 0.5}}
        (d / f"2026-01-02-h200-kimi-linear-48b-a3b{name}-decode.json").write_text(json.dumps(tp_result(tp, ms)))
    # an older TP=2 file (earlier date) loses to the newer one; other kinds and models are kept apart
    (d / "2026-01-01-h200-kimi-linear-48b-a3b-tp2-decode.json").write_text(json.dumps(tp_result(2, {"standard": {1: 99.0}})))
    (d / "2026-01-02-h200-k3-slice-tp2-decode.json").write_text(json.dumps(tp_result(2, {"standard": {1: 7.0}}, "k3-slice")))
    (d / "2026-01-02-h200-tp2-allreduce.json").write_text(json.dumps({"kind": "allreduce"}))
    data = tp_plot.collect([d])
    assert data["kimi-linear-48b-a3b"]["standard"] == {1: {1: 9.0, 2: 4.5, 4: 2.25, 8: 1.125}, 8: {1: 18.0, 2: 9.0, 4: 4.5, 8: 2.25}}
    assert data["kimi-linear-48b-a3b"]["latency_specialized"][1][4] == 1.5 and data["k3-slice"]["standard"] == {1: {2: 7.0}}
    assert tp_plot.main([str(d), "--results-dir", str(d)]) == 0
    for m in ("kimi-linear-48b-a3b", "k3-slice"):
        assert (d / f"{m}-decode-tp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| standard | 8 | 18.000 | 9.000 | 4.500 | 2.250 |" in out and "| standard | 1 | – | 7.000 |" not in out
    assert "| TP=1 | TP=2 | TP=4 | TP=8 |" in out
    assert tp_plot.main([str(d), "--out", str(tmp_path / "x.png")]) == 1  # two models, one file name
    assert tp_plot.main([str(tmp_path / "empty-dir-none")]) == 1


# ---------------------------------------------------------------- CLI
def parsers():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    cli.add_plan_parser(sub)
    bench = sub.add_parser("bench").add_subparsers()
    cli.add_bench_decode_parser(bench)
    cli.add_bench_report_parser(bench)
    return ap


def test_cli_plan_and_errors(capsys):
    ap = parsers()
    a = ap.parse_args(["plan", "--model", "kimi-k3", "--tp", "16", "--kv-cache-dtype", "fp8"])
    assert a.func(a) == 0 and "tp=16" in capsys.readouterr().out
    a = ap.parse_args(["plan", "--model", "no-such-model"])
    assert a.func(a) == 2 and "unknown model" in capsys.readouterr().err
    for bad in (["plan", "--model", "kimi-k3", "--tp", "0"], ["bench", "decode", "--model", "x", "--batch-sizes", "1,a"],
                ["bench", "decode", "--model", "x", "--backends", "fast"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    a = ap.parse_args(["bench", "decode", "--model", "tiny-kimi-linear", "--batch-sizes", "1,2",
                       "--additional-config", "{bad"])
    assert a.batch_sizes == [1, 2] and a.func(a) == 2 and "not valid JSON" in capsys.readouterr().err


# ---------------------------------------------------------------- decode harness end to end (fake runner)
class FakeRunner:
    """Random logits; counts routing like the real runners (one entry per forward when recording)."""
    last_path = "standard"

    def __init__(self, cfg):
        self.cfg, self.fallback_reasons, self.record_routing, self._routing = cfg, {}, False, []

    def forward(self, step):
        if self.record_routing:
            self._routing.append([min(16, 4 * step.num_seqs)] * len(self.cfg.moe_layers))
        return torch.randn(step.num_seqs, self.cfg.vocab_size)

    def routed_experts_per_step(self):
        return self._routing


def fake_builder(model, ecfg, dummy_weights, log):
    from peregrine.cache import ModelCache
    from peregrine.engine.engine import LLMEngine
    if ecfg.decode_backend != "standard":
        raise NotImplementedError(f"{ecfg.decode_backend} not built yet")
    cfg = resolve_model(model)[0]
    cache = ModelCache(cfg, num_blocks=ecfg.max_num_seqs * 2, block_size=ecfg.block_size,
                       num_slots=ecfg.max_num_seqs, dtype=torch.float32, device="cpu")
    return LLMEngine(FakeRunner(cfg), cfg, ecfg, cache), None


def test_bench_decode_harness_fake_runner(tmp_path):
    logs = []
    r = decode.bench_decode("tiny-kimi-linear", [1, 3], input_len=2, output_len=5, dummy_weights=True,
                            prompt_sets=2, runs=2, results_dir=str(tmp_path), builder=fake_builder, log=logs.append)
    sp = r["backends"]["latency_specialized"]
    assert sp["status"] == "not available" and "not built yet" in sp["reason"]  # reported, not skipped
    assert any(line.startswith("WARNING: backend latency_specialized") for line in logs)
    std = r["backends"]["standard"]
    assert std["status"] == "ok", std.get("traceback")
    cfg = tiny()
    for x, B in zip(std["batches"], (1, 3)):
        # per run: 1 prefill step (first token) + 4 decode steps; 2 sets x 2 runs
        assert x["n"] == len(x["samples_ms"]) == 16 and len(x["run_medians_ms"]) == 4
        assert x["paths"] == {"standard": 16}
        assert x["median_ms"] == pytest.approx(float(np.percentile(x["samples_ms"], 50)))
        assert x["distinct_experts_per_layer"] == [min(16, 4 * B)] * 4 and x["distinct_experts_source"].startswith("counted")
        assert x["bytes_per_step"] == roofline.step_bytes(cfg, B, [min(16, 4 * B)] * 4, 2 + 5 / 2)
        assert x["achieved_gbps"] == pytest.approx(x["bytes_per_step"] / (x["median_ms"] * 1e-3) / 1e9)
        if not torch.cuda.is_available():
            assert x["graph_replay_ms"] is None and x["pct_copy_bw"] is None
    files = {p.suffix for p in tmp_path.iterdir()}
    assert files == {".json", ".md"}
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["metadata"]["commit"] and saved["config"]["prompt_sets"] == 2
    assert saved["backends"]["standard"]["batches"][0]["samples_ms"]


def test_bench_decode_real_engine_tiny(tmp_path):
    pytest.importorskip("peregrine.engine.build", reason="build_engine not in this checkout yet")
    r = decode.bench_decode("tiny-kimi-linear", [1, 2], input_len=1, output_len=3, dummy_weights=True,
                            backends=("standard",), prompt_sets=1, runs=1, results_dir=str(tmp_path),
                            log=lambda *a: None)
    std = r["backends"]["standard"]
    assert std["status"] == "ok", std.get("traceback")
    for x in std["batches"]:
        assert x["n"] == 2 and x["median_ms"] > 0 and x["bytes_per_step"] > 0
        assert x["distinct_experts_mean"] <= 16


def test_git_commit_prefers_the_device_run_env(monkeypatch):
    from peregrine.bench.gpu import git_commit
    monkeypatch.setenv("PEREGRINE_COMMIT", "abc123")
    assert git_commit().startswith("abc123")
    monkeypatch.delenv("PEREGRINE_COMMIT")
    assert not git_commit().startswith("abc123")


def test_bench_decode_times_lookahead_and_reports_it_off(tmp_path):
    """An engine that looks ahead (the greedy fake runner): the samples come from steps launched ahead
    (all decode steps but the first of a run), and one more run with lookahead off is reported."""
    from fake_runner import FakeRunner as CacheFakeRunner
    from peregrine.cache import ModelCache
    from peregrine.engine.engine import LLMEngine

    def builder(model, ecfg, dummy_weights, log):
        cfg = resolve_model(model)[0]
        cache = ModelCache(cfg, num_blocks=ecfg.max_num_seqs * 2, block_size=ecfg.block_size,
                           num_slots=ecfg.max_num_seqs, dtype=torch.float32, device="cpu")
        return LLMEngine(CacheFakeRunner(cache, cfg.vocab_size, greedy=True), cfg, ecfg, cache), None

    logs = []
    r = decode.bench_decode("tiny-kimi-linear", [2], input_len=2, output_len=6, dummy_weights=True,
                            backends=("latency_specialized",), prompt_sets=2, runs=1, results_dir=None,
                            builder=builder, log=logs.append)
    b = r["backends"]["latency_specialized"]
    assert b["status"] == "ok", b.get("traceback")
    x = b["batches"][0]
    # per run 5 decode steps: the first runs at once, the other 4 were launched by the step before
    assert x["n"] == 10 and x["lookahead_steps"] == 8 and x["paths"] == {"latency_specialized": 10}
    off = x["no_lookahead"]
    assert off["n"] == 5 and off["lookahead_steps"] == 0 and off["median_ms"] > 0
    assert b["engine_stats"]["lookahead_steps"] >= 8 + 4  # the untimed warm-up run looked ahead too
    assert any("lookahead 8/10 steps; off: median" in line for line in logs)


def test_moe_split_harness_runs(tmp_path):
    """The expert-split benchmark calls the MoE kernels as the decode step does (it once broke on an
    API the MoE rewrite removed, and the GPU run failed at once): a CPU smoke run of every layout."""
    from peregrine.bench import moe_split
    assert moe_split.main(["--model", "tiny-kimi-linear", "--tp", "2", "--batch-sizes", "1,3", "--device", "cpu",
                           "--results-dir", str(tmp_path)]) == 0
    out = json.loads(next(tmp_path.glob("*moe-split-tp2*.json")).read_text())
    assert [r["batch"] for r in out["rows"]] == [1, 3] and out["tp"] == 2


def test_kernels_partial_run_gets_its_own_file_name():
    """A run of some families must not overwrite the day's file of a run of all of them."""
    from peregrine.bench import kernels
    assert kernels.result_name(kernels.FAMILIES) == "kernels"
    assert kernels.result_name(["kda"]) == "kernels-kda"
    assert kernels.result_name(["moe", "gemm"]) == "kernels-gemm-moe"  # the families' fixed order


def test_profile_prefill_idle_gaps_merge_kernels_and_name_the_longest_gap():
    """idle_gaps on a fake profile: overlapping kernels merge, the time before the first kernel is the head,
    and gaps are listed longest first with the kernels around them."""
    from types import SimpleNamespace as NS
    from peregrine.bench.profile_prefill import idle_gaps
    ev = lambda s, e, name, dev: NS(time_range=NS(start=s, end=e), name=name, device_type=dev)  # noqa: E731
    events = [ev(0, 5, "step", "DeviceType.CPU"), ev(100, 200, "a", "DeviceType.CUDA"),
              ev(150, 260, "b", "DeviceType.CUDA"), ev(300, 310, "c", "DeviceType.CUDA"),
              ev(1310, 1400, "d", "DeviceType.CUDA")]
    host = ev(400, 1300, "aten::tensor", "DeviceType.CPU")
    host.stack = ["torch/x.py(1): f", "peregrine/decode/batch.py(99): build", "peregrine/engine/engine.py(5): step"]
    events += [host, ev(0, 1400, "peregrine.complete", "DeviceType.CPU"), ev(350, 1350, "peregrine.after_forward", "DeviceType.CPU")]
    g = idle_gaps(NS(events=lambda: events), lambda m: None)
    assert g["top"][0]["in"] == ["peregrine.after_forward", "peregrine.complete"]
    assert g["top"][0]["host"] == [{"op": "aten::tensor", "us": 900,
                                    "stack": ["peregrine/decode/batch.py(99): build", "peregrine/engine/engine.py(5): step"]}]
    assert g["head_ms"] == 0.1 and g["span_ms"] == 1.3 and g["idle_ms"] == 1.04
    assert g["gaps_over_50us_ms"] == 1.0
    assert [(x["us"], x["after"], x["before"]) for x in g["top"]] == [(1000, "c", "d"), (40, "b", "c")]


def test_ttft_gc_watch_sees_the_collections_inside_its_block():
    import gc
    from peregrine.bench.ttft import GCWatch
    with GCWatch() as w:
        gc.collect(1)
    with GCWatch() as quiet:
        pass
    assert [g for g, _ in w.summary()] == [1] and w.summary()[0][1] >= 0 and quiet.summary() == []
    assert all(cb.__self__ is not w for cb in gc.callbacks if hasattr(cb, "__self__")), "its callback is removed"


def test_engine_phases_are_named_ranges_in_a_profile():
    """What profile_prefill's gap listing names: the engine's phases as peregrine.* ranges, while profiling."""
    import random
    from torch.profiler import ProfilerActivity, profile
    from peregrine.bench.ttft import first_token_s
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(max_model_len=128, max_num_seqs=2), dummy_weights=True,
                        log=lambda m: None)
    first_token_s(e, [random.Random(0).randrange(100) for _ in range(40)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first_token_s(e, [random.Random(1).randrange(100) for _ in range(40)])
    names = {ev.name for ev in prof.events() if ev.name.startswith("peregrine.")}
    assert {"peregrine.schedule", "peregrine.build_step", "peregrine.forward", "peregrine.after_forward",
            "peregrine.complete", "peregrine.accept"} <= names


def test_ttft_markdown_says_when_its_second_run_was_not_graphed():
    """A 32K breakdown's second run is eager too (no bucket holds a 32K step): the report must not call it
    'with prefill graphs'. Input: a recorded ttft payload (session 13), its flag set both ways."""
    import json
    from pathlib import Path
    from peregrine.bench.ttft import markdown
    p = json.loads(next(Path(__file__).parent.parent.glob("results/2026-12-02-session13/*-ttft-65cc9be.json")).read_text())
    p["breakdown"]["graphs_serve"] = False
    assert "prefill graphs do not serve" in markdown(p) and "ms with prefill graphs" not in markdown(p)
    p["breakdown"]["graphs_serve"] = True
    assert "579.0 ms with prefill graphs" in markdown(p)


def test_profile_prefill_host_phases_time_the_engine_and_give_its_methods_back():
    """profile_prefill --sync-debug's phase timing: each engine phase of one cold first token gets a wall
    time (the forward's inside the whole), and the engine's own methods are back afterwards."""
    import random
    from peregrine.bench.profile_prefill import HOST_PHASES, host_phases
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(max_model_len=128, max_num_seqs=2), dummy_weights=True,
                        log=lambda m: None)
    r = host_phases(e, [random.Random(1).randrange(256) for _ in range(40)], lambda m: None)
    assert 0 < r["phases_ms"]["_forward"] < r["total_ms"] and r["phases_ms"]["_build_step"] > 0
    assert set(r["phases_ms"]) <= set(HOST_PHASES) and r["syncs"] is None  # no CUDA here: no sync listing
    assert all(n not in vars(e) for n in HOST_PHASES)  # the class's methods again, not the timing wrappers


def test_bench_decode_sampled_rows_beside_greedy(tmp_path):
    """--temperature etc.: each B measured greedy, then with sampled rows on the same engine; the sampled
    steps still run ahead (drawn inside the fake runner's step) and the ratio is reported."""
    from fake_runner import FakeRunner as CacheFakeRunner
    from peregrine.cache import ModelCache
    from peregrine.engine.engine import LLMEngine

    runners = []

    def builder(model, ecfg, dummy_weights, log):
        cfg = resolve_model(model)[0]
        cache = ModelCache(cfg, num_blocks=ecfg.max_num_seqs * 2, block_size=ecfg.block_size,
                           num_slots=ecfg.max_num_seqs, dtype=torch.float32, device="cpu")
        runners.append(CacheFakeRunner(cache, cfg.vocab_size, greedy=True))
        return LLMEngine(runners[-1], cfg, ecfg, cache), None

    r = decode.bench_decode("tiny-kimi-linear", [2], input_len=2, output_len=6, dummy_weights=True,
                            backends=("latency_specialized",), prompt_sets=1, runs=1, results_dir=None,
                            builder=builder, log=lambda *a: None, sampling={"temperature": 0.6, "top_p": 0.95},
                            also_logprobs=5)
    b = r["backends"]["latency_specialized"]
    assert b["status"] == "ok", b.get("traceback")
    g, s = b["batches"][0], b["sampled_batches"][0]
    lp = b["sampled_logprobs_batches"][0]  # the same rows with logprobs 5, on the same engine
    assert lp["sampling"] == {"temperature": 0.6, "top_p": 0.95, "logprobs": 5} and lp["batch"] == 2
    assert lp["vs_greedy"] == pytest.approx(lp["median_ms"] / g["median_ms"])
    assert g["sampling"] is None and s["sampling"] == {"temperature": 0.6, "top_p": 0.95}
    assert s["lookahead_steps"] > 0 and runners[0].sampled_steps > 0
    assert s["vs_greedy"] == pytest.approx(s["median_ms"] / g["median_ms"])
    assert r["config"]["sampling"] == {"temperature": 0.6, "top_p": 0.95}


@pytest.mark.parametrize("argv,msg", [(["--top-p", "0.9"], "--temperature"), (["--temperature", "-1"], "temperature"),
                                      (["--temperature", "0.7", "--top-p", "1.5"], "top_p"),
                                      (["--temperature", "0.7", "--min-p", "2"], "min_p"),
                                      (["--also-logprobs", "5"], "--temperature"),
                                      (["--temperature", "0.7", "--also-logprobs", "-1"], "logprobs")])
def test_bench_decode_sampling_flags_are_checked(argv, msg, capsys):
    from peregrine.cli import main
    assert main(["bench", "decode", "--model", "tiny-kimi-linear", "--dummy-weights", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_moe_grouped_bench_smoke_on_cpu(monkeypatch):
    """bench moe_grouped at tiny widths (fake clock, torch's CPU grouped GEMM): every form runs, the floors
    count what the step moves."""
    from peregrine import kernels
    from peregrine.bench import moe_grouped as bench
    if torch.cuda.is_available() or not kernels.available("cpu"):
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", TOKENS=(5, 9), E=12, I=16, D=24, DTYPE=torch.float32).items():
        monkeypatch.setattr(bench, name, val)
    monkeypatch.setattr(bench, "graph_time", lambda calls, iters: ([c() for c in calls], (2.0, [2.0]))[-1])
    rows = bench.run(1000.0)
    assert [r["tokens"] for r in rows] == [5, 9]
    r = rows[1]
    assert r["act_bytes"] == 9 * 8 * (24 + 2 * 16 + 16 + 24) * 4 and r["flop"] == 2 * 9 * 8 * (2 * 16 * 24 + 16 * 24)
    assert r["weight_bytes"] == r["experts_used"] * (2 * 16 * 24 + 24 * 16) * 4


def test_drafter_step_bench_smoke_on_cpu():
    """bench drafter on the CPU: the shipped tiny drafter's padded step, both modes eager (no graphs, no copy
    bandwidth); rows per (B, L) with the bucket, bytes-based rates and the weights counted once."""
    from peregrine.bench.drafter import run
    res = run("tiny", [1, 2], [40, 100], log=lambda m: None, iters=2, paged=False)
    assert [(r["batch"], r["context"], r["bucket"]) for r in res["rows"]] == [(1, 40, 64), (2, 40, 64), (1, 100, 100), (2, 100, 100)]
    for r in res["rows"]:
        for mode in ("graph", "eager", "graph_gather"):
            x = r[mode]
            assert len(x["samples_ms"]) == 2 and x["median_ms"] > 0 and x["pct_copy_bw"] is None and not x["captured"]
    assert res["weight_bytes"] > 320 * 256 * 2 and res["copy_bandwidth"] is None
