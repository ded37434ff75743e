"""The Grafana dashboard (deploy/grafana/peregrine.json) against a real server's /metrics.

A small PromQL tokenizer pulls every series each panel's queries select; a tiny server with speculative
decoding and the prefix cache on answers a few requests (one of them a 400), and its exposition must hold each
series with the right type: inside rate() a counter or a histogram's _bucket/_sum/_count, inside
histogram_quantile() a histogram's _bucket, a counter never plotted raw. Every selector is filtered by the
replica variable, and the JSON has the structure Grafana imports (templated datasource, unique ids, gridPos,
targets with expr). The checker itself is shown to catch a misspelt series and a wrong type.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import DEVICE

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/peregrine.json"
T = 60
INSTANCE = 'instance=~"$instance"'
# what Prometheus writes itself for every scrape target, not in any /metrics
PROMETHEUS_OWN = {"up"}
# declared in /metrics but with no samples on this server: the reason
EMPTY_HERE = {"peregrine:decode_fallbacks_total": "only the specialized decode path falls back; the CPU runs the standard one"}
if DEVICE != "cuda":
    EMPTY_HERE.update({f"peregrine:gpu_memory_{k}_bytes": "a GPU's memory: declared without samples on a CPU"
                       for k in ("allocated", "reserved", "used", "total")})

# ---------------------------------------------------------------- PromQL, as far as a dashboard uses it
TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{?\w+\}?)
  | (?P<num>(?:\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(?:ms|[smhdwy])*)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<punct>[(){}\[\],])
  | (?P<op>[-+*/%^=!<>~@]+)
""", re.X)
AGGREGATIONS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values", "group", "limitk", "limit_ratio"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = LABEL_LISTS | {"and", "or", "unless", "offset", "bool", "inf", "nan"}
RATES = {"rate", "irate", "increase"}


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def series(expr: str) -> list[tuple[str, tuple[str, ...], str]]:
    """Every series an expression selects: (metric name, the functions around it innermost first, its label
    matchers without spaces). Function and aggregation names, keywords, label names in by/without/on lists and
    label matchers, strings, numbers, durations and Grafana variables are not series."""
    try:
        return _series(expr)
    except IndexError:  # ran off the end looking for a closing ), ] or }
        raise ValueError(f"unbalanced brackets in {expr!r}") from None


def _series(expr: str) -> list[tuple[str, tuple[str, ...], str]]:
    toks, out, stack, i = tokens(expr), [], [], 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if text == "(":
            stack.append("")
        elif text == ")":
            stack.pop()
        elif text == "[":  # a range or subquery window
            while toks[i][1] != "]":
                i += 1
        elif text == "{":
            raise ValueError(f"a selector without a metric name in {expr!r}")
        elif kind == "ident" and text.lower() in LABEL_LISTS:
            if nxt == "(":  # skip the label list
                while toks[i][1] != ")":
                    i += 1
        elif kind == "ident" and (nxt == "(" or text in AGGREGATIONS and nxt in LABEL_LISTS):
            i += 1
            while toks[i][1] != "(":  # sum by (le) (...): past the label list to the argument
                if toks[i][1] in LABEL_LISTS:
                    while toks[i][1] != ")":
                        i += 1
                i += 1
            stack.append(text)
        elif kind == "ident" and text.lower() not in KEYWORDS:
            matchers = ""
            if nxt == "{":
                j = i + 1
                while toks[j][1] != "}":
                    j += 1
                matchers, i = "".join(t for _, t in toks[i + 2:j]), j
            out.append((text, tuple(f for f in reversed(stack) if f), matchers))
        i += 1
    if stack:
        raise ValueError(f"unbalanced parentheses in {expr!r}")
    return out


# ---------------------------------------------------------------- the exposition and the checker
def exposition(text: str) -> dict[str, tuple[str, str, int]]:
    """sample name -> (family, type, samples of that name) for every family declared, samples or not."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "summary": ["", "_sum", "_count"],
                "info": ["_info"]}
    out = {}
    for fam in text_string_to_metric_families(text):
        for suf in suffixes.get(fam.type, [""]):
            name = fam.name + suf
            out[name] = (fam.name, fam.type, sum(s.name == name for s in fam.samples))
    return out


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # a collapsed row keeps its panels inside
    return out


def problems(dash: dict, exposed: dict) -> list[str]:
    bad = []
    queries = [(f"panel {p['id']} {p['title']!r}", t["expr"]) for p in panels(dash) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((\S+), (\w+)\)", q)
            if not m:
                bad.append(f"variable {v['name']}: not label_values(metric, label): {q!r}")
            elif m.group(1) not in exposed:
                bad.append(f"variable {v['name']}: {m.group(1)} is not in /metrics")
    for where, expr in queries:
        try:
            found = series(expr)
        except ValueError as e:
            bad.append(f"{where}: {e}")
            continue
        if not found:
            bad.append(f"{where}: selects no series: {expr!r}")
        if "histogram_quantile" in expr and not re.search(r"\bby \([^)]*\ble\b", expr):
            bad.append(f"{where}: histogram_quantile without le in the aggregation's labels")
        for name, funcs, matchers in found:
            if INSTANCE not in matchers:
                bad.append(f"{where}: {name} is not filtered by the replica variable ({INSTANCE})")
            if name in PROMETHEUS_OWN:
                continue
            if name not in exposed:
                bad.append(f"{where}: {name} is not in /metrics")
                continue
            family, typ, n = exposed[name]
            if n == 0 and name not in EMPTY_HERE:
                bad.append(f"{where}: {name} is declared but has no samples")
            if n and name in EMPTY_HERE:
                bad.append(f"{where}: {name} has samples: EMPTY_HERE is out of date")
            counter_like = typ == "counter" or typ in ("histogram", "summary") and name != family
            if "histogram_quantile" in funcs and not (typ == "histogram" and name.endswith("_bucket")):
                bad.append(f"{where}: histogram_quantile over {name}, not a histogram's _bucket (a {typ} sample)")
            if funcs and funcs[0] in RATES and not counter_like:
                bad.append(f"{where}: {funcs[0]}() over {name}, a {typ}")
            if counter_like and not set(funcs) & RATES:
                bad.append(f"{where}: the {typ} sample {name} is plotted raw, not through rate()")
    return bad


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def metrics_text():
    """A tiny server with the prefix cache and n-gram speculation on, after a few requests (a prompt sent twice:
    prefix-cache hits; a repetitive one: drafts; a stream; an invalid request: an error), scraped."""
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    from peregrine.server import BackgroundServer, create_app
    eng, tok = build_engine("tiny-kimi-linear", EngineConfig(
        max_model_len=256, dtype="fp32", max_num_seqs=4, block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}), dummy_weights=True, log=lambda *a: None)
    assert eng.prefix_cache.enabled
    with BackgroundServer(create_app(eng, tok, "tiny")) as s:
        body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        for prompt in ["the peregrine falcon " * 3, "the peregrine falcon " * 3, "abcd" * 8]:
            r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=T)
            assert r.status_code == 200, r.text
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=T,
                          json={**body, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            assert r.status_code == 200 and [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"
        assert httpx.post(s.url + "/v1/completions", json={**body, "prompt": "a", "max_tokens": -1},
                          timeout=T).status_code == 400
        text = httpx.get(s.url + "/metrics", timeout=T).text
    assert eng.stats["spec"]["num_drafts"] > 0 and eng.prefix_cache.stats["hit_tokens"] > 0
    return text


@pytest.fixture(scope="module")
def dash():
    return json.loads(DASHBOARD.read_text())


# ---------------------------------------------------------------- tests
def test_tokenizer():
    e = ('histogram_quantile(0.99, sum by (le, instance) (rate(peregrine:x_bucket{instance=~"$instance",le!="1"}'
         '[$__rate_interval]))) / ignoring(position) group_left sum without (a) (g{b="sum(c)"} offset 5m) '
         '+ 1e3 * scalar(sum(irate(c_total[5m:1m]))) and on(instance) up')
    assert series(e) == [("peregrine:x_bucket", ("rate", "sum", "histogram_quantile"), 'instance=~"$instance",le!="1"'),
                         ("g", ("sum",), 'b="sum(c)"'), ("c_total", ("irate", "sum", "scalar"), ""), ("up", (), "")]
    for bad in ("sum(rate(x[5m])", "x)", "rate(x[5m)", "x{a=\"b\"", "{__name__=\"x\"}", "x # y"):
        with pytest.raises(ValueError):
            series(bad)


def test_grafana_structure(dash):
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ds, inst = {v["name"]: v for v in dash["templating"]["list"]}["datasource"], \
        {v["name"]: v for v in dash["templating"]["list"]}["instance"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    assert inst["type"] == "query" and inst["multi"] and inst["includeAll"] and inst["allValue"] == ".*"
    assert inst["datasource"]["uid"] == "${datasource}"
    ps = panels(dash)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells = set()
    for p in ps:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["title"] and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    titles = " ".join(p["title"].lower() for p in ps)
    for what in ("time to first token", "inter-token", "time per output token", "running and waiting", "prefix-cache",
                 "acceptance", "fallbacks", "gpu memory", "resident memory", "cache usage", "failed"):
        assert what in titles, what


def test_every_series_a_panel_queries_is_in_metrics(dash, metrics_text):
    bad = problems(dash, exposition(metrics_text))
    assert not bad, "\n".join(bad)
    # the fleet view needs all of these (the list)
    names = {n for p in panels(dash) for t in p.get("targets", []) for n, _, _ in series(t["expr"])}
    for n in ("peregrine:time_to_first_token_seconds_bucket", "peregrine:inter_token_latency_seconds_bucket",
              "peregrine:num_requests_running", "peregrine:num_requests_waiting", "peregrine:prefix_cache_hits_total",
              "peregrine:spec_accepted_tokens_total", "peregrine:decode_fallbacks_total", "peregrine:gpu_memory_used_bytes",
              "process_resident_memory_bytes", "peregrine:request_errors_total"):
        assert n in names, n


def test_gpu_memory_series_on_a_gpu(dash, monkeypatch):
    """On a GPU the memory families the GPU panel reads have samples (the CPU server declares them empty)."""
    import torch
    from peregrine.server.metrics import _gpu_memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 40 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 45 << 30)
    got = {s.name: s.value for fam in _gpu_memory(torch.device("cuda", 0)) for s in fam.samples}
    queried = {n for p in panels(dash) for t in p.get("targets", []) for n, _, _ in series(t["expr"]) if "gpu_memory" in n}
    assert queried and queried <= set(got), queried - set(got)
    assert got["peregrine:gpu_memory_used_bytes"] == 50 << 30


@pytest.mark.parametrize("old,new,says", [
    ("peregrine:prefix_cache_hits_total", "peregrine:prefix_cache_hit_total", "prefix_cache_hit_total is not in /metrics"),
    ("peregrine:time_to_first_token_seconds_bucket", "peregrine:time_to_first_token_seconds_sum",
     "histogram_quantile over peregrine:time_to_first_token_seconds_sum"),
    ("rate(peregrine:spec_draft_tokens_total", "rate(peregrine:num_requests_waiting", "rate() over peregrine:num_requests_waiting, a gauge"),
    ("(peregrine:num_requests_running{", "(peregrine:prompt_tokens_total{", "prompt_tokens_total is plotted raw"),
    ('process_resident_memory_bytes{instance=~"$instance"}', "process_resident_memory_bytes", "not filtered by the replica"),
    ("peregrine:host_memory_trims_total", "peregrine:host_memory_trims", "host_memory_trims is not in /metrics"),
])
def test_the_check_catches_a_wrong_series(dash, metrics_text, old, new, says):
    d = copy.deepcopy(dash)
    hits = 0
    for p in panels(d):
        for t in p.get("targets", []):
            hits += old in t["expr"]
            t["expr"] = t["expr"].replace(old, new)
    assert hits, old
    found = problems(d, exposition(metrics_text))
    assert any(says in f for f in found), found
