"""Prometheus metrics of one server (own registry, so several servers can live in one process).

Latencies are observed by the server as tokens arrive; engine-side counters
(steps by path, fallback reasons) and gauges (running, waiting, cache usage) are
read from the engine at scrape time. Memory, so growth shows before it is an outage:
the process's resident size as every Prometheus client exports it
(process_resident_memory_bytes, the series vLLM's dashboards read), the host
allocator's trims (host_memory.py), and on a GPU the device memory in use (the GPU families are
declared on every host, with samples only on a GPU, so a dashboard reads one schema everywhere:
deploy/grafana/peregrine.json, checked against this exposition by tests/test_dashboard.py).
"""
from __future__ import annotations

import torch
from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter,
                               Histogram, disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# buckets span a sub-ms decode step up to minute-long queues
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _safe_copy(d) -> dict:
    """The engine thread may grow these dicts while we read them: retry on a concurrent change."""
    for _ in range(5):
        try:
            return dict(d)
        except RuntimeError:
            continue
    return {}


VLLM_LABELS = ["model_name", "engine"]  # vLLM's series carry these; engine: the data-parallel rank ("0")


class EngineCollector:
    def __init__(self, engine, model_name: str = ""):
        self.engine, self.model_name = engine, model_name

    def _vllm(self, kind, name: str, doc: str, value):
        """The same figure under vLLM's name and labels: what aiperf (its server-side prefix-cache hit rate), llm-d's
        scheduler and vLLM's dashboards read."""
        m = kind(f"vllm:{name}", doc, labels=VLLM_LABELS)
        m.add_metric([self.model_name, "0"], value)
        return m

    def collect(self):
        e = self.engine
        running, waiting = e.num_running, e.num_waiting
        g = GaugeMetricFamily("peregrine:num_requests_running", "Requests being decoded now")
        g.add_metric([], running)
        yield g
        yield self._vllm(GaugeMetricFamily, "num_requests_running", "Requests being decoded now", running)
        g = GaugeMetricFamily("peregrine:num_requests_waiting", "Requests queued for a cache slot")
        g.add_metric([], waiting)
        yield g
        yield self._vllm(GaugeMetricFamily, "num_requests_waiting", "Requests queued for a cache slot", waiting)
        blocks, pc = e.cache.blocks, getattr(e, "prefix_cache", None)
        free = pc.num_free if pc is not None else blocks.num_free  # cached blocks nobody reads are free to take
        usage = 1.0 - free / max(1, blocks.num_blocks)
        g = GaugeMetricFamily("peregrine:cache_usage_perc", "Fraction of MLA cache blocks in use (0..1)")
        g.add_metric([], usage)
        yield g
        yield self._vllm(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent usage", usage)
        if pc is not None:
            st = _safe_copy(pc.stats)
            yield self._vllm(CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in terms of number of "
                             "queried tokens", st.get("query_tokens", 0))
            yield self._vllm(CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                             "tokens", st.get("hit_tokens", 0))
        if pc is not None and pc.enabled:
            for key, name, doc in (("query_tokens", "queries", "Prompt tokens looked up in the prefix cache"),
                                   ("hit_tokens", "hits", "Prompt tokens reused from the prefix cache"),
                                   ("evicted_blocks", "evicted_blocks", "Cached MLA blocks evicted for new ones"),
                                   ("snapshots", "snapshots", "KDA state snapshots kept at block ends")):
                c = CounterMetricFamily(f"peregrine:prefix_cache_{name}", doc)
                c.add_metric([], st.get(key, 0))
                yield c
        g = GaugeMetricFamily("peregrine:kda_slot_usage_perc", "Fraction of KDA state slots in use (0..1)")
        g.add_metric([], 1.0 - e.cache.num_free_slots / max(1, e.cache.num_slots))
        yield g
        c = CounterMetricFamily("peregrine:decode_steps", "Engine steps by forward path", labels=["path"])
        for path, n in _safe_copy(e.stats.get("steps_by_path", {})).items():
            c.add_metric([path], n)
        yield c
        c = CounterMetricFamily("peregrine:decode_fallbacks", "Steps the specialized path handed to the standard one, by reason",
                                labels=["reason"])
        for reason, n in _safe_copy(e.stats.get("fallback_reasons", {})).items():
            c.add_metric([reason], n)
        yield c
        kinds = _safe_copy(e.stats.get("step_kinds", {}))
        c = CounterMetricFamily("peregrine:step_seconds", "Engine step time by kind (decode, prefill, mixed; decode + prefill piece, prefill pieces)",
                                labels=["kind"])
        for kind, v in kinds.items():
            c.add_metric([kind], v.get("seconds", 0.0))
        yield c
        c = CounterMetricFamily("peregrine:steps", "Engine steps by kind (decode, prefill, mixed; decode + prefill piece, prefill pieces)", labels=["kind"])
        for kind, v in kinds.items():
            c.add_metric([kind], v.get("steps", 0))
        yield c
        c = CounterMetricFamily("peregrine:decode_lookahead_steps",
                                "Decode steps launched before the previous step's tokens were read (decode lookahead)")
        c.add_metric([], e.stats.get("lookahead_steps", 0))
        yield c
        sp = _safe_copy(e.stats.get("spec") or {})
        if sp:  # speculative decoding (only when --speculative-config is set)
            for key, name, doc in (("num_drafts", "drafts", "Verified drafts (sequence-steps with at least one draft token)"),
                                   ("num_draft_tokens", "draft_tokens", "Draft tokens verified"),
                                   ("num_accepted_tokens", "accepted_tokens", "Draft tokens accepted")):
                c = CounterMetricFamily(f"peregrine:spec_{name}", doc)
                c.add_metric([], sp.get(key, 0))
                yield c
            c = CounterMetricFamily("peregrine:spec_accepted_tokens_per_pos", "Draft tokens accepted, by draft position",
                                    labels=["position"])
            for pos, n in enumerate(sp.get("accepted_per_pos", [])):
                c.add_metric([str(pos)], n)
            yield c
            g = GaugeMetricFamily("peregrine:spec_mean_acceptance_length",
                                  "Tokens per verified draft: 1 + accepted / drafts", labels=["acceptance"])
            synthetic = sp.get("synthetic_acceptance_length") is not None
            g.add_metric(["synthetic" if synthetic else "model"], sp.get("mean_acceptance_length", 0.0))
            yield g
            if synthetic:
                g = GaugeMetricFamily("peregrine:spec_synthetic_acceptance_length",
                                      "Configured synthetic acceptance length: drafts accepted by chance, outputs are "
                                      "not the model's (benchmark mode)")
                g.add_metric([], sp["synthetic_acceptance_length"])
                yield g
        hm = _safe_copy(e.stats.get("host_memory") or {})
        c = CounterMetricFamily("peregrine:host_memory_trims", "Times the engine gave the host allocator's free pages back")
        c.add_metric([], hm.get("trims", 0))
        yield c
        c = CounterMetricFamily("peregrine:host_memory_trim_seconds", "Engine time spent giving free host pages back")
        c.add_metric([], hm.get("seconds", 0.0))
        yield c
        dev = getattr(e, "device", None)
        yield from _gpu_memory(dev if dev is not None and dev.type == "cuda" else None)


def _gpu_memory(dev):
    """This process's device memory: what PyTorch's tensors hold, what its caching allocator reserved,
    and the device's whole use (other processes, CUDA graphs, NCCL and the context included).
    Without a GPU (dev None) the families are declared with no samples."""
    if dev is not None:
        free, total = torch.cuda.mem_get_info(dev)
        values = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), total - free, total)
    for i, (name, doc) in enumerate((("gpu_memory_allocated_bytes", "Device memory held by live tensors"),
                                     ("gpu_memory_reserved_bytes", "Device memory reserved by PyTorch's caching allocator"),
                                     ("gpu_memory_used_bytes", "Device memory in use on the GPU, by anybody"),
                                     ("gpu_memory_total_bytes", "Device memory of the GPU"))):
        g = GaugeMetricFamily(f"peregrine:{name}", doc, labels=["device"])
        if dev is not None:
            g.add_metric([str(dev)], values[i])
        yield g


class Metrics:
    def __init__(self, engine, model_name: str):
        disable_created_metrics()  # the *_created series only double the scrape size
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.ttft = Histogram("peregrine:time_to_first_token_seconds", "Arrival to first token", lbl,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("peregrine:inter_token_latency_seconds", "Gap between consecutive tokens of a request", lbl,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("peregrine:e2e_request_latency_seconds", "Arrival to last token", lbl,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("peregrine:prompt_tokens", "Prompt tokens of admitted requests", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("peregrine:generation_tokens", "Generated tokens", lbl,
                                         registry=r).labels(model_name)
        self._success = Counter("peregrine:request_success", "Finished requests by finish reason",
                                lbl + ["finished_reason"], registry=r)
        self._errors = Counter("peregrine:request_errors", "Requests answered with an error, by HTTP status",
                               lbl + ["status"], registry=r)
        self.engine_errors = Counter("peregrine:engine_step_errors", "Engine steps that raised", lbl,
                                     registry=r).labels(model_name)
        self.model_name = model_name
        r.register(EngineCollector(engine, model_name))
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*: as the default registry has
            r.register(c)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
