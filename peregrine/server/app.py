"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE
streaming with usage), /v1/models, /health, /metrics.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 malformed or unsupported request (param: the field), 404 unknown model
(code "model_not_found"), 413 body over --max-body-bytes, 429 queue full
(--max-queue waiting requests), 500 engine failure (the server keeps serving:
a failure the engine pins on one request fails that request alone, one it
cannot fails the requests in flight), 503 engine thread dead.
A client that disconnects aborts its request, which frees its slot and blocks.
Text excludes the final eos/stop token (usage and token_ids count it) and is cut
before a stop string. n > 1: n engine requests, one per choice, on one queue.
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
from .async_engine import AsyncEngine, EngineStepError
from .chat import ChatTemplate
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
                 defaults=None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allow_forced_replies: bool = False):
        self.engine, self.tokenizer, self.name = engine, tokenizer, served_model_name
        self.allow_forced_replies = allow_forced_replies  # benchmarks only: requests may carry forced_tokens
        self.max_queue, self.chat_template, self.defaults = max_queue, chat_template, defaults
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics(engine, served_model_name)
        self.aeng = AsyncEngine(engine, on_step_error=lambda e: self.metrics.engine_errors.inc())
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_cfg.vocab_size
        self.eos = set(engine.model_cfg.eos_token_ids)
        self.fmt = LogprobFormatter(tokenizer)
        if getattr(engine, "tokenizer", None) is None:  # outputs then carry text, and stop strings work
            engine.tokenizer = tokenizer


def err(st: ServerState, e: APIError) -> JSONResponse:
    st.metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine, tokenizer, served_model_name: str, max_queue: int = DEFAULT_MAX_QUEUE,
               chat_template: ChatTemplate | None = None, defaults=None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allow_forced_replies: bool = False) -> FastAPI:
    """defaults: the model's GenerationConfig (sampling defaults for requests that set none);
    allow_forced_replies (benchmarks only): /v1/completions takes forced_tokens, the reply the engine emits."""
    st = ServerState(engine, tokenizer, served_model_name, max_queue, chat_template or ChatTemplate(), defaults,
                     max_body_bytes, allow_forced_replies)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        st.aeng.start()
        yield
        st.aeng.stop()

    app = FastAPI(title="peregrine", lifespan=lifespan)
    app.state.peregrine = st

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # a bug must answer, not hang or kill the server
        log.exception("unhandled error on %s", request.url.path)
        return err(st, APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error"))

    @app.get("/health")
    async def health():
        if not st.aeng.alive:
            return JSONResponse(error_body("engine thread is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.name, "object": "model", "created": now(), "owned_by": "peregrine",
                                            "max_model_len": st.max_model_len, "vocab_size": st.vocab_size}]}

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(st, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(st, request, chat=True)

    return app


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
        body = parse_json(await read_body(request, st.max_body_bytes))
        if chat:
            if not isinstance(body, dict):
                raise APIError(400, "request body must be a JSON object")
            ids_fn = lambda b: st.tokenizer.encode(st.chat_template.render(b.get("messages")))  # noqa: E731
            default_max = lambda n: st.max_model_len - n  # noqa: E731  chat: the rest of the context
        else:
            ids_fn = lambda b: completion_prompt_ids(b, st.tokenizer.encode)  # noqa: E731
            default_max = lambda n: DEFAULT_COMPLETION_TOKENS  # noqa: E731
        req = parse_common(body, st.name, st.max_model_len, st.vocab_size, ids_fn, default_max, chat=chat,
                           defaults=st.defaults, allow_forced=st.allow_forced_replies)
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
    echo = _echo_text(st, body, req.prompt_ids) if req.echo else None
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now(),
            "model": st.name}
    if req.stream:
        return StreamingResponse(stream(st, q, trs, req, base, chat, echo), media_type="text/event-stream")
    return await collect(st, request, q, trs, req, base, chat, echo)


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
                st.metrics.error(500)
                failed = True
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
            yield sse({**base, "choices": [_choice(chat, delta, fin, True, ids, tr.index, lp)], "usage": None})
            if out.finished:
                done.add(out.request_id)
        if len(done) == len(trs) and req.include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(req.prompt_ids), _n_out(req, trs))})
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
        choices.append(_choice(chat, text, fin, False, ids if req.return_token_ids else None, tr.index, lp))
    return {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": usage(len(req.prompt_ids), _n_out(req, trs))}


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
