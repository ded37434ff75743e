"""The head check's verdict table (peregrine.bench.check): each issue #57 target judged from result files
shaped as `bench decode` and `bench spec` write them; the limits here are the issue's words, typed in."""
import json

from peregrine.bench import check


def _decode(greedy, sampled, logprobs, gpu="NVIDIA H200", model="kimi-linear-48b-a3b"):
    b = {"status": "ok", "batches": [{"batch": B, "median_ms": ms} for B, ms in greedy.items()],
         "sampled_batches": [{"batch": B, "median_ms": ms, "vs_greedy": ms / greedy[B]} for B, ms in sampled.items()],
         "sampled_logprobs_batches": [{"batch": B, "median_ms": ms, "vs_greedy": ms / greedy[B]}
                                      for B, ms in logprobs.items()]}
    return {"kind": "decode", "model": model, "metadata": {"gpu": gpu, "commit": "abc"},
            "copy_bandwidth": {"gbps": 4200.0}, "backends": {"latency_specialized": b}}


def _spec(speedups):
    """speedups: {(B, L): x plain} at k = 7, width auto; plus an n-gram and a full-width row the verdict ignores."""
    batches = {}
    for (B, L), s in speedups.items():
        batches.setdefault(B, [{"label": "plain"}, {"label": "ngram k=7", "k": 7, "speedup_vs_plain": 0.5},
                               {"label": f"synthetic {L:g} k=7 full", "k": 7, "acceptance_length": L, "width": "full",
                                "speedup_vs_plain": 0.1}])
        batches[B].append({"label": f"synthetic {L:g} k=7 auto", "k": 7, "acceptance_length": L, "width": "auto",
                           "speedup_vs_plain": s, "median_verify_step_ms": 3.0, "width_steps": [0] * 8})
    return {"kind": "spec_decode", "model": "kimi-linear-48b-a3b", "metadata": {"gpu": "NVIDIA H200"},
            "copy_bandwidth": {"gbps": 4200.0}, "batches": [{"batch": B, "configs": c} for B, c in batches.items()]}


def _verdicts(tmp_path, *docs):
    for i, d in enumerate(docs):
        (tmp_path / f"r{i}.json").write_text(json.dumps(d))
    (tmp_path / "other.json").write_text(json.dumps({"kind": "kernels"}))  # not a decode or spec run: ignored
    return {r["target"]: r for r in check.check(tmp_path)["rows"]}


def test_sampled_ratios_judged_per_batch_size(tmp_path):
    g = {1: 2.35, 2: 3.2, 4: 4.5, 8: 6.9}
    v = _verdicts(tmp_path, _decode(g, {1: 2.35 * 1.02, 2: 3.2 * 1.04, 4: 4.5, 8: 6.9 * 1.031},
                                    {1: 2.35 * 1.049, 2: 3.2 * 1.06, 4: 4.5 * 1.05, 8: 6.9}))
    s = lambda B: v[f"sampled 0.6/0.95 / greedy step, B={B}"]["verdict"]  # noqa: E731
    lp = lambda B: v[f"sampled + logprobs 5 / greedy step, B={B}"]["verdict"]  # noqa: E731
    assert [s(B) for B in (1, 2, 4, 8)] == ["met", "short", "met", "short"]  # <= 1.03
    assert [lp(B) for B in (1, 2, 4, 8)] == ["met", "short", "met", "met"]  # <= 1.05
    rec = v["greedy step B=1 vs last record"]  # the H200 48B record 2.344-2.357 ms, 1 % allowed
    assert rec["verdict"] == "met" and rec["figure"] == 2.35


def test_greedy_drift_and_unknown_record(tmp_path):
    v = _verdicts(tmp_path, _decode({1: 2.40}, {1: 2.40}, {1: 2.40}))
    assert v["greedy step B=1 vs last record"]["verdict"] == "short"  # 2.40 > 2.357 x 1.01
    v = _verdicts(tmp_path, _decode({1: 3.0}, {}, {}, gpu="NVIDIA H100 80GB HBM3"))
    assert v["greedy step B=1 (ms)"]["verdict"] == "n/a"  # no record to drift from on this card
    assert v["sampled 0.6/0.95 / greedy step, B=1"]["verdict"] == "n/a"  # not measured is not met


def test_speculation_targets_and_floor(tmp_path):
    v = _verdicts(tmp_path, _spec({(1, 3.78): 1.71, (8, 3.78): 1.14, (1, 6.0): 2.2, (8, 6.0): 1.9,
                                   (1, 1.5): 1.01, (8, 1.5): 0.97, (1, 1.2): 0.5}))
    assert v["synthetic 3.78, k=7, auto: x plain, B=1"]["verdict"] == "met"    # >= 1.7
    assert v["synthetic 3.78, k=7, auto: x plain, B=8"]["verdict"] == "short"  # < 1.15
    assert v["synthetic 6, k=7, auto: x plain, B=1"]["verdict"] == "met"       # >= 2.2
    assert "synthetic 6, k=7, auto: x plain, B=8" not in v                     # the issue sets no B = 8 target at 6
    floor = v["synthetic, any length >= 1.5: worst x plain"]
    assert floor["verdict"] == "short" and floor["figure"] == 0.97 and "B=8" in floor["note"]  # 1.2 is below 1.5


def test_sampled_speedups_judged_against_the_greedy_ones(tmp_path):
    d = _spec({(1, 3.78): 1.8, (8, 3.78): 1.2})
    for entry, (s, v) in zip(d["batches"], ((1.75, 1.75 / 1.8), (1.1, 1.1 / 1.2))):
        entry["configs"].append({"label": "synthetic 3.78 k=7 auto sampled", "k": 7, "acceptance_length": 3.78,
                                 "width": "auto", "sampled": True, "speedup_vs_plain": s, "vs_greedy_speedup": v})
    v = _verdicts(tmp_path, d)
    assert v["synthetic 3.78 sampled speedup / greedy speedup, B=1"]["verdict"] == "met"    # 0.972 >= 0.95
    assert v["synthetic 3.78 sampled speedup / greedy speedup, B=8"]["verdict"] == "short"  # 0.917
    assert v["synthetic 3.78, k=7, auto: x plain, B=1"]["figure"] == 1.8  # the greedy row still judged alone


def test_cli_prints_the_table_last(tmp_path, capsys):
    _verdicts(tmp_path, _decode({1: 2.35}, {1: 2.35}, {1: 2.35}), _spec({(1, 3.78): 1.8}))
    assert check.main([str(tmp_path), "--out", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("| synthetic, any length") and "4200 GB/s" in out[0]
    assert json.loads((tmp_path / "v.json").read_text())["rows"]
    assert check.main([str(tmp_path / "nothing")]) == 2


def _agent(tpot, ttft, itl99, spec: bool, sampled: bool = False, forced: bool = True, errors: int = 0,
           lookahead: float = 0.0):
    """A `bench serve --workload agent` result at c = 8 (and a c = 1 level the verdict ignores)."""
    server = {"lookahead_steps": lookahead, "engine_steps": 100.0, "acceptance_length": 3.1 if spec else None}
    if spec:
        server |= {"drafts": 10.0, "draft_tokens": 70.0, "accepted_tokens": 21.0}
    lv = lambda c: {"concurrency": c, "errors": errors, "completed": 64 - errors, "tpot_ms": {"p50": tpot},  # noqa: E731
                    "ttft_ms": {"p50": ttft}, "itl_ms": {"p99": itl99}, "server": server}
    return {"kind": "serve_agent", "model": "kimi-linear-48b-a3b", "meta": {"gpu": "NVIDIA H200", "commit": "abc"},
            "sampling": {"temperature": 0.6, "top_p": 0.95} if sampled else None, "agent": {"forced": forced},
            "label": "x", "levels": [lv(1), lv(8)]}


def test_agent_serving_targets_pair_the_speculative_server_with_the_plain_one(tmp_path):
    v = _verdicts(tmp_path, _agent(4.0, 100.0, 20.0, spec=True), _agent(6.0, 97.0, 12.0, spec=False, lookahead=900),
                  _agent(5.0, 104.0, 26.0, spec=True, sampled=True, errors=1), _agent(6.0, 100.0, 12.0, False, True),
                  _agent(5.9, 96.0, 12.0, spec=False, forced=False, lookahead=950))
    g = lambda t: v[f"agent c=8 greedy: {t}"]  # noqa: E731
    s = lambda t: v[f"agent c=8 sampled: {t}"]  # noqa: E731
    assert g("TPOT p50 spec / plain")["verdict"] == "met" and g("TPOT p50 spec / plain")["figure"] == 0.667
    assert "acceptance length 3.10" in g("TPOT p50 spec / plain")["note"]
    assert g("TTFT p50 spec / plain")["verdict"] == "met"        # 100 / 97 = 1.031 <= 1.05
    assert g("ITL p99 spec (ms)")["verdict"] == "met"
    assert s("TPOT p50 spec / plain")["verdict"] == "short"      # 5 / 6 = 0.833 > 0.8
    assert s("TTFT p50 spec / plain")["verdict"] == "met"        # 1.04
    assert s("ITL p99 spec (ms)")["verdict"] == "short"          # 26 > 25
    assert v["agent c=8 spec sampled: errors"]["verdict"] == "short"
    assert v["agent c=8 plain greedy unforced: errors"]["verdict"] == "met"
    lb = v["agent c=8 greedy: TPOT p50 plain forced / unforced"]
    assert lb["verdict"] == "n/a" and lb["figure"] == 1.017 and "lookahead steps 900 vs 950" in lb["note"]
    (tmp_path / "alone").mkdir()
    v = _verdicts(tmp_path / "alone", _agent(4.0, 100.0, 20.0, spec=True))
    assert v["agent c=8 greedy: spec vs plain"]["verdict"] == "n/a"  # a pair needs both servers' runs
