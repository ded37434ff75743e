"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE
streaming with usage), /v1/models, /health, /metrics; for a router in front of several replicas
(vllm-router) vLLM's /v1/completions/render, /v1/chat/completions/render, /tokenize, /detokenize,
/get_server_info and /kv_event_sources.

Readiness (Lifecycle): with a loader the server listens at once and builds the engine on a thread; until
it is ready /health and every other endpoint answer 503 (vLLM's error body). SIGTERM (serve's server)
starts a drain: /health answers 503 at once, requests that still arrive are served until none has come for
--drain-grace seconds (a router keeps routing here until its health check sees the 503), then the server stops
listening and answers what still reaches it with 503 and `Connection: close`; the requests in flight finish, those
still running after --drain-timeout end with a 503 error, then the process exits.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 malformed or unsupported request (param: the field), 404 unknown model
(code "model_not_found"), 413 body over --max-body-bytes, 429 queue full
(--max-queue waiting requests), 500 engine failure (the server keeps serving:
a failure the engine pins on one request fails that request alone, one it
cannot fails the requests in flight), 503 engine thread dead.
A client that disconnects aborts its request, which frees its slot and blocks.
Text excludes the final eos/stop token (usage and token_ids count it) and is cut
before a stop string. n > 1: n engine requests, one per choice, on one queue.
Chat answers go through the request's reply parser (reply.py: --reasoning-parser, --tool-call-parser, a named or
"required" tool_choice) into reasoning_content / reasoning, content and tool_calls, streamed as OpenAI's deltas;
finish_reason is "tool_calls" when an "auto" answer called tools or a "required" one stopped with calls.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.request import RequestError
from .async_engine import AsyncEngine, EngineStepError, ShutdownError
from . import reply as replies
from . import structured, tools as tool_req
from .chat import ChatTemplate, template_kwargs
from .limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from .metrics import CONTENT_TYPE, Metrics
from .logprob_format import LogprobFormatter, prompt_entries
from .protocol import (DEFAULT_COMPLETION_TOKENS, APIError, completion_prompt_ids, error_body, new_id, now,
                       parse_common, parse_json, usage)

log = logging.getLogger(__name__)
REPLACEMENT = "\ufffd"   # what a cut multi-byte character decodes to: held back until complete


class Tracker:
    """Per-choice bookkeeping: latency metrics, incremental text, logprobs."""

    def __init__(self, st: "ServerState", arrival: float, stop_ids: set[int], index: int = 0):
        self.st, self.arrival, self.stop_ids, self.index = st, arrival, stop_ids, index
        self.ids: list[int] = []
        self.sent = ""
        self.text: str | None = None     # the engine's final text (cut before a stop string)
        self.last: float | None = None
        self.finish_reason: str | None = None
        self.logprobs: list = []         # TokenLogprob of each output token
        self.prompt_logprobs: list | None = None
        self.offset = 0                  # text_offset of the next streamed token (completions logprobs)
        self.cached = 0                  # prompt tokens the prefix cache served
        self.reply = None                # reply.Reply: this choice's reasoning / content / tool-call parser
        self.n_calls = 0                 # tool calls streamed so far

    def text_ids(self) -> list[int]:
        if self.finish_reason == "stop" and self.ids and self.ids[-1] in self.stop_ids:
            return self.ids[:-1]
        return self.ids

    def update(self, stamp: float, out) -> str:
        m = self.st.metrics
        if out.new_token_ids:
            m.generation_tokens.inc(len(out.new_token_ids))
            if self.last is None:
                m.ttft.observe(stamp - self.arrival)
            else:  # a speculative step brings several tokens at once: the gap counts once per token
                n = len(out.new_token_ids)
                for _ in range(n):
                    m.itl.observe((stamp - self.last) / n)
            self.last = stamp
        self.ids = list(out.output_token_ids)
        self.cached = getattr(out, "num_cached_tokens", 0)
        if out.finished:
            self.finish_reason = out.finish_reason
            if out.finish_reason != "error":  # answered as an error (counted there)
                m.success(out.finish_reason or "unknown")
            if out.finish_reason not in ("abort", "error"):
                m.e2e.observe(stamp - self.arrival)
        self.logprobs += getattr(out, "logprobs", None) or []
        if getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = out.prompt_logprobs
        delta = getattr(out, "text_delta", None)
        if delta is not None:  # the engine detokenizes (and applies stop strings)
            self.sent += delta
            if out.finished:
                self.text = out.text if getattr(out, "text", None) is not None else self.sent
            return delta
        text = self.st.tokenizer.decode(self.text_ids())
        if not out.finished:
            text = text.rstrip(REPLACEMENT)
        if not text.startswith(self.sent):  # the decoder changed its mind on earlier text: wait
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def final_text(self) -> str:
        return self.text if self.text is not None else self.st.tokenizer.decode(self.text_ids())


class ServerState:
    def __init__(self, engine, tokenizer, served_model_name: str, max_queue: int, chat_template: ChatTemplate,
                 defaults=None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allow_forced_replies: bool = False,
                 kv_events=None, model_path: str | None = None, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, enable_auto_tool_choice: bool = False):
        self.engine, self.tokenizer, self.name = engine, tokenizer, served_model_name
        # vLLM's --tool-call-parser / --reasoning-parser / --enable-auto-tool-choice (reply.py)
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.auto_tools = enable_auto_tool_choice and tool_parser is not None
        self.model_path = model_path or served_model_name
        self.allow_forced_replies = allow_forced_replies  # benchmarks only: requests may carry forced_tokens
        self.max_queue, self.chat_template, self.defaults = max_queue, chat_template, defaults
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics(engine, served_model_name)
        self.kv_events = kv_events  # kv_events.KVEventPublisher: the prefix cache's blocks, published per step
        after_step = None
        if kv_events is not None:
            from ..kv_events import BlockEvents
            pc = engine.prefix_cache
            tracker = BlockEvents(needs_state=pc.needs_state)
            pc.listener = tracker
            kv_events.block_size = engine.cache.block_size
            after_step = lambda: kv_events.publish(tracker.take())  # noqa: E731
        self.aeng = AsyncEngine(engine, on_step_error=lambda e: self.metrics.engine_errors.inc(), after_step=after_step)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_cfg.vocab_size
        self.eos = set(engine.model_cfg.eos_token_ids)
        self.fmt = LogprobFormatter(tokenizer)
        if getattr(engine, "tokenizer", None) is None:  # outputs then carry text, and stop strings work
            engine.tokenizer = tokenizer


def unavailable(message: str) -> dict:
    """vLLM's error body for a 503."""
    return {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}}


class Lifecycle:
    """The server's phase: loading (the model loads, warm-up captures graphs), ready, draining (after SIGTERM:
    /health gets 503; new requests are served while `accepting`, then get 503; in-flight requests finish), failed
    (the model did not load). inflight counts the requests being served (/v1/..., /tokenize, /detokenize), streams
    until their last byte; last_arrival is when the latest POST of them came in."""

    def __init__(self, phase: str = "loading", drain_timeout: float = 60.0, drain_grace: float = 0.0):
        self.phase, self.drain_timeout, self.drain_grace = phase, drain_timeout, drain_grace
        self.detail = "the model is loading"
        self.st: ServerState | None = None
        self.error: BaseException | None = None
        self.inflight = 0
        self.last_arrival = 0.0
        self.drain_began = 0.0
        self.late = 0                 # POSTs that arrived while draining and were served
        self.accepting = False        # draining, and still serving new requests (the grace)
        self.force = False            # a second signal while draining: cut the requests now
        self.on_drained = None        # serve's server: exit once drained
        self.on_failed = None         # serve's server: exit when the model failed to load
        self.on_stop_accepting = None  # serve's server: close the listening socket and idle connections

    def begin_drain(self) -> None:
        if self.phase == "ready":
            self.phase, self.detail = "draining", "the server is shutting down: it takes no new requests"
            self.drain_began, self.accepting = time.monotonic(), self.drain_grace > 0
            taking = (f"new requests are served until none has arrived for {self.drain_grace:g} s (--drain-grace)"
                      if self.accepting else "new requests answer 503")
            log.warning("draining: %d request(s) in flight; /health answers 503; %s; exit when the requests in "
                        "flight are done or after %g s (--drain-timeout)", self.inflight, taking, self.drain_timeout)

    def stop_accepting(self, why: str) -> None:
        """End the grace (idempotent): new requests get 503 and, with serve's server, new connections are refused."""
        if self.accepting:
            self.accepting = False
            log.warning("draining: %s: stopped taking requests (%d served while draining, %d in flight)",
                        why, self.late, self.inflight)
        stop, self.on_stop_accepting = self.on_stop_accepting, None
        if stop is not None:
            stop()


class _Gate:
    """Pure ASGI middleware: 503 (vLLM's body) for everything but a ready server, except while draining /metrics
    and, during the grace, every request but /health; counts the requests in flight. Once a draining server stops
    accepting, its 503s carry `Connection: close`, so a client's kept-alive connection does not bring it more."""
    COUNTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, life: Lifecycle):
        self.app, self.life = app, life

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        life, path = self.life, scope["path"]
        draining = life.phase == "draining"
        if life.phase != "ready" and not (draining and (path == "/metrics" or (life.accepting and path != "/health"))):
            body = json.dumps(unavailable(life.detail)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if draining and not life.accepting:
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        counted = path.startswith(self.COUNTED)
        if counted:
            life.inflight += 1
            if scope["method"] == "POST":  # work; a GET (/v1/models) does not hold a draining server open
                life.last_arrival = time.monotonic()
                life.late += int(draining)
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                life.inflight -= 1


DRAIN_POLL_S = 0.05  # how often the drain looks at the requests in flight and the grace


async def _drain_watch(life: Lifecycle) -> None:
    """Once draining: serve what still arrives until none has for drain_grace, then stop accepting; wait for the
    in-flight requests (at most drain_timeout from the signal), fail what is left with a 503, then hand over to the
    server's exit (life.on_drained)."""
    while life.phase != "draining":
        await asyncio.sleep(DRAIN_POLL_S)
    deadline = life.drain_began + life.drain_timeout
    while time.monotonic() < deadline and not life.force:
        if not life.accepting or time.monotonic() >= max(life.drain_began, life.last_arrival) + life.drain_grace:
            life.stop_accepting(f"no request for {life.drain_grace:g} s (--drain-grace)")
            if life.inflight == 0:
                break
        await asyncio.sleep(DRAIN_POLL_S)
    life.stop_accepting("a second signal" if life.force else f"{life.drain_timeout:g} s (--drain-timeout) passed")
    if life.inflight > 0 and life.st is not None:
        n = life.st.aeng.cut(f"the server shut down before this request finished (it waited "
                             f"{life.drain_timeout:g} s, --drain-timeout)")
        log.warning("drain: %d request(s) still running after %g s end with a 503", n, life.drain_timeout)
        end = time.monotonic() + 5.0
        while life.inflight > 0 and time.monotonic() < end:
            await asyncio.sleep(DRAIN_POLL_S)
    log.warning("drained: exiting (%d request(s) served while draining)", life.late)
    if life.on_drained is not None:
        life.on_drained()


def err(st: ServerState, e: APIError) -> JSONResponse:
    st.metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine=None, tokenizer=None, served_model_name: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               chat_template: ChatTemplate | None = None, defaults=None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allow_forced_replies: bool = False,
               loader=None, kv_events=None, drain_timeout: float = 60.0, drain_grace: float = 0.0,
               model_path: str | None = None, tool_parser: str | None = None, reasoning_parser: str | None = None,
               enable_auto_tool_choice: bool = False) -> FastAPI:
    """defaults: the model's GenerationConfig (sampling defaults for requests that set none);
    allow_forced_replies (benchmarks only): /v1/completions takes forced_tokens, the reply the engine emits.
    loader (instead of engine and tokenizer): called on a thread once the server listens, it returns a dict of
    this function's engine, tokenizer, served_model_name, chat_template, defaults, model_path; every endpoint
    answers 503 until it returns. kv_events: a kv_events.KVEventPublisher fed the prefix cache's block events.
    drain_timeout, drain_grace: serve's --drain-timeout and --drain-grace (Lifecycle); grace 0: a draining server
    refuses new requests at once.
    tool_parser ("kimi_k2" | "kimi_k3"), reasoning_parser ("kimi_k3"), enable_auto_tool_choice: vLLM's flags."""
    life = Lifecycle("loading" if loader is not None else "ready", drain_timeout, drain_grace)
    opts = dict(max_queue=max_queue, max_body_bytes=max_body_bytes, allow_forced_replies=allow_forced_replies,
                kv_events=kv_events, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                enable_auto_tool_choice=enable_auto_tool_choice)

    def make_state(engine, tokenizer, served_model_name, chat_template=None, defaults=None, model_path=None):
        return ServerState(engine, tokenizer, served_model_name, chat_template=chat_template or ChatTemplate(),
                           defaults=defaults, model_path=model_path, **opts)

    if loader is None:
        life.st = make_state(engine, tokenizer, served_model_name, chat_template, defaults, model_path)

    def load() -> None:
        try:
            st = make_state(**loader())
            st.aeng.start()
            life.st = app.state.peregrine = st
            life.phase, life.detail = "ready", ""
        except BaseException as e:  # noqa: BLE001  (reported by serve, which exits)
            life.error, life.phase, life.detail = e, "failed", f"the model failed to load: {e}"
            if life.on_failed is not None:
                life.on_failed(e)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if loader is None:
            life.st.aeng.start()
        else:
            threading.Thread(target=load, name="peregrine-load", daemon=True).start()
        watch = asyncio.ensure_future(_drain_watch(life))
        yield
        watch.cancel()
        if life.st is not None:
            life.st.aeng.stop()
        if kv_events is not None:
            kv_events.close()

    app = FastAPI(title="peregrine", lifespan=lifespan)
    app.state.life = life
    app.state.peregrine = life.st  # the ServerState (tests read it); set when a loader finishes
    app.add_middleware(_Gate, life=life)

    def state() -> ServerState:
        return life.st

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # a bug must answer, not hang or kill the server
        log.exception("unhandled error on %s", request.url.path)
        return err(state(), APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error"))

    @app.get("/health")
    async def health():
        if not state().aeng.alive:
            return JSONResponse(error_body("engine thread is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        st = state()
        return {"object": "list", "data": [{"id": st.name, "object": "model", "created": now(), "owned_by": "peregrine",
                                            "root": st.model_path, "max_model_len": st.max_model_len,
                                            "vocab_size": st.vocab_size, "block_size": st.engine.cache.block_size}]}

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: probes that check the endpoint exists
    async def metrics():
        return Response(state().metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(state(), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(state(), request, chat=True)

    # ---- what a router needs from a worker, in vLLM's spelling ----
    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        st = state()
        try:
            _, req = await _parse(st, request, chat=False)
        except APIError as e:
            return err(st, e)
        return [{"request_id": new_id("cmpl"), "model": st.name, "token_ids": req.prompt_ids}]

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request):
        st = state()
        try:
            _, req = await _parse(st, request, chat=True)
        except APIError as e:
            return err(st, e)
        return {"request_id": new_id("chatcmpl"), "model": st.name, "token_ids": req.prompt_ids}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        st = state()
        try:
            body = parse_json(await read_body(request, st.max_body_bytes))
            if not isinstance(body, dict):
                raise APIError(400, "request body must be a JSON object")
            chat = "messages" in body
            if body.get("model", st.name) != st.name:
                raise APIError(404, f"The model `{body.get('model')}` does not exist: this server serves `{st.name}`",
                               "model", code="model_not_found")
            if chat:
                ids = _chat_prompt_ids(st, body, lenient=True)[0]
            else:
                ids = completion_prompt_ids(body, st.tokenizer.encode)
        except APIError as e:
            return err(st, e)
        except (ValueError, TypeError) as e:
            return err(st, APIError(400, f"cannot tokenize: {e}", "messages" if "messages" in body else "prompt"))
        return {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        st = state()
        try:
            body = parse_json(await read_body(request, st.max_body_bytes))
            ids = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    and 0 <= t < st.vocab_size for t in ids):
                raise APIError(400, f"'tokens' must be a list of token ids in [0, {st.vocab_size})", "tokens")
        except APIError as e:
            return err(st, e)
        return {"prompt": st.tokenizer.decode(ids)}

    @app.get("/get_server_info")
    async def server_info():
        st = state()
        bs = st.engine.cache.block_size
        return {"model_id": st.name, "model_path": st.model_path, "served_model_name": st.name,
                "kv_block_size": bs, "effective_attention_block_size": bs, "max_model_len": st.max_model_len,
                "enable_prefix_caching": st.engine.prefix_cache.enabled,
                "kv_events": st.kv_events is not None}

    @app.get("/kv_event_sources")
    async def kv_event_sources():
        st = state()
        return st.kv_events.sources() if st.kv_events is not None else {}

    return app


async def _parse(st: ServerState, request: Request, chat: bool):
    """(body, ParsedRequest): a completions or chat request checked and tokenized (serving and render alike)."""
    body = parse_json(await read_body(request, st.max_body_bytes))
    ctx: dict = {}
    guided_fn = None
    if chat:
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")

        def ids_fn(b):
            ids, ctx["tools"], ctx["thinking"] = _chat_prompt_ids(st, b)
            return ids
        guided_fn = lambda b: tool_req.guided(ctx["tools"], b, structured.guided(b))  # noqa: E731
        default_max = lambda n: st.max_model_len - n  # noqa: E731  chat: the rest of the context
    else:
        ids_fn = lambda b: completion_prompt_ids(b, st.tokenizer.encode)  # noqa: E731
        default_max = lambda n: DEFAULT_COMPLETION_TOKENS  # noqa: E731
    req = parse_common(body, st.name, st.max_model_len, st.vocab_size, ids_fn, default_max, chat=chat,
                       defaults=st.defaults, allow_forced=st.allow_forced_replies, guided_fn=guided_fn)
    req.tools, req.thinking = ctx.get("tools"), ctx.get("thinking", True)
    return body, req


def _chat_prompt_ids(st: ServerState, body: dict, lenient: bool = False):
    """-> (the chat prompt's token ids, its tools.ToolRequest, thinking on): the tools and the template's
    arguments checked, the conversation rendered by the model's template. lenient (/tokenize): tool_choice "auto"
    is not refused on a server without a tool parser (nothing is generated)."""
    treq = tool_req.parse_tools(body, st.auto_tools or lenient, k3=st.tool_parser == "kimi_k3")
    kw, thinking = template_kwargs(body, st.chat_template.k3, treq)
    return st.chat_template.prompt_ids(st.tokenizer, body.get("messages"), treq.tools, **kw), treq, thinking


def _echo_text(st: ServerState, body: dict, ids: list[int]) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    return p if isinstance(p, str) else st.tokenizer.decode(ids)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to pass `limit` bytes (by its Content-Length, or while read)."""
    def too_big(n: str) -> APIError:
        return APIError(413, f"request body is {n} bytes; this server takes at most {limit} (--max-body-bytes)")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise too_big(size)
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big(f"more than {limit}")
        parts.append(chunk)
    return b"".join(parts)


async def handle(st: ServerState, request: Request, chat: bool):
    arrival = time.perf_counter()
    rids: list[str] = []
    try:
        body, req = await _parse(st, request, chat)
        if not st.aeng.alive:
            raise APIError(503, "engine thread is not running", type_="server_error")
        if st.engine.num_waiting >= st.max_queue:
            raise APIError(429, f"server is busy: {st.engine.num_waiting} requests are already waiting "
                                f"(limit {st.max_queue}); retry later", type_="rate_limit_exceeded")
        rid = new_id("chatcmpl" if chat else "cmpl")
        q = asyncio.Queue()  # every choice's outputs, each tagged with its request id
        try:
            for i in range(req.n):
                p = req.params if req.n == 1 else dataclasses.replace(
                    req.params, seed=None if req.params.seed is None else req.params.seed + i)
                rids.append(rid if req.n == 1 else f"{rid}-{i}")
                st.aeng.add(rids[-1], req.prompt_ids, p, queue=q, forced=req.forced_tokens)
        except RequestError as e:
            for r in rids[:-1]:  # all choices or none
                st.aeng.abort(r)
                st.aeng.release(r)
            raise APIError(400, str(e), e.param) from None
    except APIError as e:
        return err(st, e)
    st.metrics.prompt_tokens.inc(len(req.prompt_ids) * req.n)
    stop_ids = set(req.params.stop_token_ids) | (st.eos if not req.params.ignore_eos else set())
    trs = {r: Tracker(st, arrival, stop_ids, i) for i, r in enumerate(rids)}
    if chat:
        for tr in trs.values():
            tr.reply = _make_reply(st, req)
    echo = _echo_text(st, body, req.prompt_ids) if req.echo else None
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now(),
            "model": st.name}
    if req.stream:
        return StreamingResponse(stream(st, q, trs, req, base, chat, echo), media_type="text/event-stream")
    return await collect(st, request, q, trs, req, base, chat, echo)


def _make_reply(st: ServerState, req):
    t = req.tools
    if t is None:
        return None
    return replies.make_reply(st.tool_parser, st.reasoning_parser, t.choice, t.parallel, t.name, req.thinking)


def _finish_reason(req, fin, n_calls: int):
    """vLLM's: "tool_calls" when an "auto" answer called tools, or a "required" one stopped with calls."""
    choice = req.tools.choice if req.tools is not None else "none"
    if n_calls and (choice == "auto" or (choice == "required" and fin == "stop")):
        return "tool_calls"
    return fin


def _message(st: ServerState, pieces: list) -> dict:
    m = replies.join(pieces)
    calls = [replies.tool_call_json(c) for c in m["tool_calls"]]
    msg = {"role": "assistant", "content": None if calls and m["content"] == "" else m["content"]}
    if st.reasoning_parser is not None:  # vLLM's old and new names
        msg["reasoning_content"] = msg["reasoning"] = m["reasoning"]
    if calls:
        msg["tool_calls"] = calls
    return msg


def _logprobs(st: ServerState, req, chat: bool, tr: Tracker, new: list, with_prompt: bool):
    """This chunk's (or the whole answer's) logprobs object, or None when not asked for."""
    if not req.logprobs:
        return None
    if chat:
        return st.fmt.chat(new)
    entries = prompt_entries(req.prompt_ids, tr.prompt_logprobs) if with_prompt else []
    obj, tr.offset = st.fmt.completion(entries + ([] if req.echo_only else new), tr.offset)
    return obj


def _choice(chat: bool, text: str | None, finish, stream: bool, token_ids=None, index: int = 0, logprobs=None) -> dict:
    c = {"index": index}
    if chat:
        c["delta" if stream else "message"] = ({"content": text} if stream else {"role": "assistant", "content": text})
    else:
        c["text"] = text
    c["logprobs"] = logprobs
    c["finish_reason"] = finish
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def _cached(trs) -> int:
    """The prompt's cached tokens, counted once as the prompt is (n > 1: the first choice's)."""
    return next(iter(trs.values())).cached


def _n_out(req, trs) -> int:
    return 0 if req.echo_only else sum(len(t.ids) for t in trs.values())


async def stream(st, q, trs: dict, req, base, chat, echo: str | None):
    done: set[str] = set()
    started: set[str] = set()
    failed = False
    try:
        if chat:  # OpenAI opens a chat stream with the role
            for tr in trs.values():
                yield sse({**base, "choices": [{"index": tr.index, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}], "usage": None})
        while len(done) < len(trs):
            stamp, out = await q.get()
            if isinstance(out, EngineStepError):
                failed = True
                if isinstance(out, ShutdownError):
                    st.metrics.error(503)
                    yield sse(unavailable(str(out)))
                else:
                    st.metrics.error(500)
                    yield sse(error_body(str(out), "server_error"))
                break
            tr = trs.get(out.request_id)
            if tr is None or out.request_id in done:
                continue
            if out.finish_reason == "error":  # this request's own failure: the others in the batch go on
                st.metrics.error(500)
                failed = True
                yield sse(error_body(_failed(out), "server_error"))
                break
            first = out.request_id not in started
            started.add(out.request_id)
            n_lp = len(tr.logprobs)
            delta = tr.update(stamp, out)
            new_lp = tr.logprobs[n_lp:]
            if req.echo_only:  # the prompt alone, once, as if max_tokens 0 were reached
                if not out.finished:
                    continue
                delta, fin, new, first = echo, "length", None, True
            else:
                delta = (echo if first and echo is not None else "") + delta
                fin, new = out.finish_reason, out.new_token_ids
            lp = _logprobs(st, req, chat, tr, new_lp, with_prompt=first and req.echo)
            ids = (new or []) if req.return_token_ids else None
            if tr.reply is not None:
                pieces = tr.reply.feed(delta) + (tr.reply.finish() if out.finished else [])
                tr.n_calls += sum(p[0] == "call" for p in pieces)
                d = replies.delta(pieces)
                if not d and not out.finished and lp is None and not ids:
                    continue  # nothing to show yet (a marker's start held back)
                c = {"index": tr.index, "delta": d, "logprobs": lp,
                     "finish_reason": _finish_reason(req, fin, tr.n_calls) if out.finished else None}
                if ids is not None:
                    c["token_ids"] = ids
                yield sse({**base, "choices": [c], "usage": None})
                if out.finished:
                    done.add(out.request_id)
                continue
            yield sse({**base, "choices": [_choice(chat, delta, fin, True, ids, tr.index, lp)], "usage": None})
            if out.finished:
                done.add(out.request_id)
        if len(done) == len(trs) and req.include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(req.prompt_ids), _n_out(req, trs), _cached(trs))})
        yield "data: [DONE]\n\n"
    finally:  # runs on normal end, on error and when the client disconnects (task cancelled)
        _cleanup(st, trs, done, failed)


def _failed(out) -> str:
    return f"request failed in the engine: {out.error}"


def _cleanup(st, trs: dict, done: set, failed: bool) -> None:
    for rid in trs:
        if rid not in done:
            st.aeng.abort(rid)
            if not failed:  # the client went away
                st.metrics.success("abort")
        st.aeng.release(rid)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(st, request, q, trs: dict, req, base, chat, echo: str | None):
    done: set[str] = set()
    failed = False
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while len(done) < len(trs):
            get = asyncio.ensure_future(q.get())
            finished, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if get not in finished:  # client went away: nobody to answer
                get.cancel()
                return Response(status_code=499)
            stamp, out = get.result()
            if isinstance(out, EngineStepError):
                failed = True
                if isinstance(out, ShutdownError):
                    st.metrics.error(503)
                    return JSONResponse(unavailable(str(out)), status_code=503)
                return err(st, APIError(500, str(out), type_="server_error"))
            tr = trs.get(out.request_id)
            if tr is None or out.request_id in done:
                continue
            if out.finish_reason == "error":  # this request's own failure: the others in the batch go on
                failed = True
                return err(st, APIError(500, _failed(out), type_="server_error"))
            tr.update(stamp, out)
            if out.finished:
                done.add(out.request_id)
    finally:
        watcher.cancel()
        _cleanup(st, trs, done, failed)
    choices = []
    for tr in trs.values():
        text = tr.final_text()
        if req.echo_only:
            text, fin, ids = echo, "length", []
        else:
            text, fin, ids = (echo or "") + text, tr.finish_reason, tr.ids
        lp = _logprobs(st, req, chat, tr, tr.logprobs, with_prompt=req.echo)
        c = _choice(chat, text, fin, False, ids if req.return_token_ids else None, tr.index, lp)
        if tr.reply is not None:
            pieces = tr.reply.feed(text) + tr.reply.finish()
            c["message"] = _message(st, pieces)
            c["finish_reason"] = _finish_reason(req, fin, len(c["message"].get("tool_calls", ())))
        choices.append(c)
    return {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": usage(len(req.prompt_ids), _n_out(req, trs), _cached(trs))}


class BackgroundServer:
    """uvicorn in a daemon thread on a pre-bound loopback socket (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 5.0):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        cfg = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
