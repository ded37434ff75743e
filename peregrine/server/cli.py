"""argparse glue for `peregrine serve` and `peregrine bench serve`.

add_serve_parser(subparsers) / add_bench_serve_parser(bench_subparsers) each add
one sub-command whose func(args) returns an exit code.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from ..bench.cli import int_list  # one parser for comma lists
from ..engine_args import add_engine_args, engine_config
from .limits import DEFAULT_DRAIN_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from .reply import REASONING_PARSERS, TOOL_PARSERS

# a draining replica serves what still comes until none has for this long: vllm-router routes to it until its health
# check has seen /health 503, and retries a refused request on the replica its policy picks, the same one
DEFAULT_DRAIN_GRACE_S = 5.0


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and for a "
                                          "router in front of several replicas vLLM's /v1/completions/render, "
                                          "/v1/chat/completions/render, /tokenize, /detokenize, /get_server_info and "
                                          "/kv_event_sources. /health answers 503 while the model loads and while "
                                          "SIGTERM drains (--drain-grace, --drain-timeout).")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port, 1..65535 (default 8000)")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the --model value)")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"waiting requests beyond which new ones get 429 (default {DEFAULT_MAX_QUEUE})")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body; a larger one gets 413 (default {DEFAULT_MAX_BODY_BYTES >> 20} MiB)")
    g.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_S,
                   help=f"seconds SIGTERM waits for in-flight requests (default {DEFAULT_DRAIN_S:g}); while it waits "
                        "/health answers 503, after it the requests still running end with a 503")
    g.add_argument("--drain-grace", type=float, default=DEFAULT_DRAIN_GRACE_S,
                   help="after SIGTERM, the requests that still arrive are served until none has for this many seconds "
                        f"(default {DEFAULT_DRAIN_GRACE_S:g}), then the server stops listening: a router sends a replica "
                        "work until its health check sees /health 503, and retries a refused request on the same "
                        "replica (vllm-router: keep --health-check-interval-secs x --health-failure-threshold under "
                        "it); 0: refuse new requests at once")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the prefix cache's blocks as vLLM's KV cache events for a KV-aware router, in vLLM's "
                        "spelling, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (fields: "
                        "enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, "
                        "max_queue_size, topic; needs pip install 'peregrine[fleet]'; docs/serving.md)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted for vLLM's command lines; every answer's usage carries "
                        "prompt_tokens_details.cached_tokens (the prompt tokens the prefix cache served) anyway")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: chat requests with tools (tool_choice \"auto\", the default with tools) have the "
                        "model's tool calls read back into message.tool_calls; needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the model's tool-call format, in vLLM's names: kimi_k2 (Kimi-Linear, Kimi-K2: "
                        "<|tool_calls_section_begin|> ...), kimi_k3 (K3's XTML tools channel)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="the model's reasoning format, in vLLM's names: kimi_k3 (K3's think channel, returned as "
                        "message.reasoning_content and .reasoning)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server and access log detail (default info)")
    g.add_argument("--allow-forced-replies", action="store_true",
                   help="benchmarks only: /v1/completions takes \"forced_tokens\" (token ids), the reply the engine "
                        "emits whatever the model says, so speculation is measured on recorded text at the engine's "
                        "real cost (`bench serve --workload agent`); off: a request carrying it is a 400")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    """Every option is checked first; then the server listens at once (/health answers 503) while the model
    loads and warm-up captures its graphs on a thread, and serves when that is done. SIGTERM drains."""
    import uvicorn

    from ..config import ConfigError, resolve_model
    from ..kv_events import parse_kv_events_config
    from .app import create_app

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes < 1:
        raise ConfigError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.drain_timeout < 0:
        raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.drain_grace < 0:
        raise ConfigError(f"--drain-grace must be >= 0 seconds, got {args.drain_grace}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (kimi_k2 or kimi_k3): the parser reads "
                          "the model's tool calls")
    ecfg = engine_config(args)  # every engine option checked before the model loads
    events_cfg = parse_kv_events_config(args.kv_events_config)
    if events_cfg is not None and not ecfg.enable_prefix_caching:
        raise ConfigError("--kv-events-config: KV cache events report the prefix cache, which "
                          "--no-enable-prefix-caching turns off")
    _, folder = resolve_model(args.model)  # an unknown model is an error before anything listens
    logging.basicConfig(level=args.log_level.upper(), format="[peregrine] %(levelname)s %(name)s: %(message)s")
    log = lambda m: print(f"[peregrine] {m}", file=sys.stderr, flush=True)  # noqa: E731
    publisher = None
    if events_cfg is not None:
        from ..kv_events import KVEventPublisher
        publisher = KVEventPublisher(events_cfg, say=log)  # binds now: a busy address fails before the model loads
    name = args.served_model_name or args.model

    def load() -> dict:
        from .. import compile_log
        from ..engine.build import build_engine, warm_up
        from ..generation_config import GenerationConfig
        from .chat import ChatTemplate
        from .k3_chat import CONTROL
        from .reply import check_tokens, special_id
        compile_log.install(log)  # PEREGRINE_LOG_COMPILES=1: kernels the warm-up misses are named when they compile
        engine, tok = build_engine(args.model, ecfg, dummy_weights=args.dummy_weights, log=log)
        warm_up(engine, log)  # graphs captured and plans built now, not at a request's first prompt of each size
        compile_log.serving()
        tmpl = ChatTemplate(folder, model_type=engine.model_cfg.model_type)
        if tmpl.k3 and any(special_id(tok, t) is None for t in CONTROL):  # e.g. a config-only folder, dummy weights
            log(f"Kimi K3's chat format needs the special tokens {', '.join(CONTROL)}, which this tokenizer "
                f"({tok.kind}) lacks: chat requests use the simple template")
            tmpl = ChatTemplate()
        check_tokens(tok, args.tool_call_parser, args.reasoning_parser, tmpl.k3)
        gen = GenerationConfig.from_folder(folder)
        log(f"ready: serving '{name}' on http://{args.host}:{args.port} (tokenizer: {tok.kind}, chat template: "
            f"{tmpl.kind}, end ids {list(engine.model_cfg.eos_token_ids)}, max queue {args.max_queue}, "
            f"KV block size {engine.cache.block_size})")
        if args.tool_call_parser or args.reasoning_parser:
            log(f"tool-call parser {args.tool_call_parser} (auto tool choice "
                f"{'on' if args.enable_auto_tool_choice else 'off'}), reasoning parser {args.reasoning_parser}")
        if args.allow_forced_replies:
            log("--allow-forced-replies: requests may carry forced_tokens, replies the model did not choose (benchmarks only)")
        if (gen.temperature, gen.top_p, gen.top_k) != (None, None, None):
            log(f"sampling defaults from generation_config.json: temperature {gen.temperature}, top_p {gen.top_p}, top_k {gen.top_k}")
        return dict(engine=engine, tokenizer=tok, served_model_name=name, chat_template=tmpl, defaults=gen,
                    model_path=str(args.model))

    app = create_app(loader=load, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                     allow_forced_replies=args.allow_forced_replies, kv_events=publisher,
                     drain_timeout=args.drain_timeout, drain_grace=args.drain_grace, tool_parser=args.tool_call_parser,
                     reasoning_parser=args.reasoning_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)
    life = app.state.life
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5.0)  # the drain ran before: only closing connections is left
    server = _DrainingServer(config, life)
    life.on_drained = lambda: setattr(server, "should_exit", True)
    life.on_failed = lambda e: setattr(server, "should_exit", True)
    life.on_stop_accepting = server.stop_listening
    log(f"listening on http://{args.host}:{args.port}: /health answers 503 until the model is loaded and warm")
    # uvicorn re-raises a caught SIGTERM to the handler that was there before once it has shut down: a no-op one
    # makes a clean drain exit 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if life.error is not None:
        raise life.error
    return 0


class _DrainingServer:
    """uvicorn's Server whose first SIGTERM / SIGINT starts the app's drain (Lifecycle) instead of closing the
    listening socket at once: /health answers 503 and what still arrives is served through the grace; then
    stop_listening closes the socket and the idle connections while the requests in flight finish; a second signal
    ends them now (503). While the model loads a signal exits at once."""

    def __new__(cls, config, life):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if life.phase == "ready":
                    self._captured_signals.append(sig)
                    life.begin_drain()
                elif life.phase == "draining":
                    life.force = True
                else:
                    super().handle_exit(sig, frame)

            def stop_listening(self):
                """New connections are refused; a kept-alive one closes now if idle, else after its response
                (uvicorn's own shutdown, which runs later, finds them closed)."""
                for s in getattr(self, "servers", ()):
                    s.close()
                for c in list(self.server_state.connections):
                    c.shutdown()
        return Server(config)


def add_bench_serve_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("serve", help="serving load: TTFT, TPOT, ITL, tok/s/user, throughput (docs/benchmarks.md §3)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to drive (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--max-concurrency", type=int_list, default=[1, 2, 4, 8], help="levels, e.g. 1,2,4,8")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default 5 x concurrency)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens, eos ignored (default 128)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--token-range", default="32,127", help="prompt token ids drawn from [LO,HI) (default 32,127)")
    p.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="requests arrive as a Poisson process of R per second (default: all at once, "
                        "--max-concurrency in flight)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs the server uses, for throughput per GPU")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before the levels (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and lengths (default 0)")
    p.add_argument("--label", default=None, help="configuration name in the JSON and the plot")
    p.add_argument("--results-dir", default="results", help="where the JSON and PNG go (default results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    from ..bench.cli import add_sampling_args
    add_sampling_args(p, "sampled requests (default: greedy, temperature 0)")
    g = p.add_argument_group("workload (docs/benchmarks.md §3d)")
    g.add_argument("--workload", choices=["random", "agent", "agentx"], default="random",
                   help="random: random token-id prompts (default); agent: coding-agent sessions, every turn re-sending "
                        "the conversation, each reply sent as forced_tokens (the server needs --allow-forced-replies); "
                        "agentx: InferenceX's agentic benchmark, aiperf's AgentX scenario replaying --traces "
                        "(docs/benchmarks.md §3e)")
    g.add_argument("--traces", default=None, metavar="DIR",
                   help="agentx: a folder of kv-cache-tester traces (*.json), e.g. tests/agentx/traces")
    g.add_argument("--duration", type=float, default=None, metavar="S",
                   help="agentx: profiled seconds per level after its warmup (default 1800, the scenario's; it refuses "
                        "under 900)")
    g.add_argument("--sessions", type=int, default=None,
                   help="agent: sessions per level (default: the level's --max-concurrency)")
    g.add_argument("--turns", type=int, default=None, help="agent: turns per session (default 8)")
    g.add_argument("--context-chars", type=int, default=None,
                   help="agent: characters of source a session shows over its turns (default 120000: with a 163K "
                        "vocabulary the last turns' contexts are ~19-25K tokens)")
    g.add_argument("--max-reply-tokens", type=int, default=None, help="agent: cut each reply to this many tokens")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="agent: the model's vocabulary (default: the server's /v1/models vocab_size)")
    g.add_argument("--unforced", action="store_true",
                   help="agent: no forced_tokens (the model's own replies; same prompts and max_tokens)")
    g.add_argument("--salt", default=None,
                   help="agent: text each session opens with, so runs share no cached prefix; agentx: the seed of the "
                        "cache-bust markers (default: random, recorded in the JSON)")
    p.set_defaults(func=cmd_bench_serve)
    return p


def cmd_bench_serve(args) -> int:
    from ..bench.serve import run_cli
    return run_cli(args)


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError
    from ..engine.request import RequestError
    p = argparse.ArgumentParser(prog="python -m peregrine.server")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    add_serve_parser(sub)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", metavar="BENCH")
    bsub.required = True
    add_bench_serve_parser(bsub)
    args = p.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ConfigError, RequestError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
