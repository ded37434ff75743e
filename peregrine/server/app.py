"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE
streaming with usage), /v1/models, /health, /metrics.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}:
400 malformed or unsupported request, 429 queue full (--max-queue waiting
requests), 500 engine failure (the server keeps serving), 503 engine thread dead.
A client that disconnects aborts its request, which frees its slot and blocks.
Text excludes the final eos/stop token (usage and token_ids count it).
"""
from __future__ import annotations

import asyncio
import contextlib
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
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (DEFAULT_COMPLETION_TOKENS, APIError, completion_prompt_ids, error_body, new_id, now,
                       parse_common, usage)

log = logging.getLogger(__name__)
from .cli import DEFAULT_MAX_QUEUE  # noqa: E402  (one definition, in the import-light cli module)
REPLACEMENT = "\ufffd"   # what a cut multi-byte character decodes to: held back until complete


class Tracker:
    """Per-request token bookkeeping: latency metrics and incremental text."""

    def __init__(self, st: "ServerState", arrival: float, stop_ids: set[int]):
        self.st, self.arrival, self.stop_ids = st, arrival, stop_ids
        self.ids: list[int] = []
        self.sent = ""
        self.last: float | None = None
        self.finish_reason: str | None = None

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
            m.success(out.finish_reason or "unknown")
            if out.finish_reason != "abort":
                m.e2e.observe(stamp - self.arrival)
        text = self.st.tokenizer.decode(self.text_ids())
        if not out.finished:
            text = text.rstrip(REPLACEMENT)
        if not text.startswith(self.sent):  # the decoder changed its mind on earlier text: wait
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


class ServerState:
    def __init__(self, engine, tokenizer, served_model_name: str, max_queue: int, chat_template: ChatTemplate):
        self.engine, self.tokenizer, self.name = engine, tokenizer, served_model_name
        self.max_queue, self.chat_template = max_queue, chat_template
        self.metrics = Metrics(engine, served_model_name)
        self.aeng = AsyncEngine(engine, on_step_error=lambda e: self.metrics.engine_errors.inc())
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_cfg.vocab_size
        self.eos = engine.model_cfg.eos_token_id


def err(st: ServerState, e: APIError) -> JSONResponse:
    st.metrics.error(e.status)
    return JSONResponse(e.body(), status_code=e.status)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(engine, tokenizer, served_model_name: str, max_queue: int = DEFAULT_MAX_QUEUE,
               chat_template: ChatTemplate | None = None) -> FastAPI:
    st = ServerState(engine, tokenizer, served_model_name, max_queue, chat_template or ChatTemplate())

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
                                            "max_model_len": st.max_model_len}]}

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


async def handle(st: ServerState, request: Request, chat: bool):
    arrival = time.perf_counter()
    try:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if chat:
            if not isinstance(body, dict):
                raise APIError(400, "request body must be a JSON object")
            ids_fn = lambda b: st.tokenizer.encode(st.chat_template.render(b.get("messages")))  # noqa: E731
            default_max = lambda n: st.max_model_len - n  # noqa: E731  chat: the rest of the context
        else:
            ids_fn = lambda b: completion_prompt_ids(b, st.tokenizer.encode)  # noqa: E731
            default_max = lambda n: DEFAULT_COMPLETION_TOKENS  # noqa: E731
        req = parse_common(body, st.name, st.max_model_len, st.vocab_size, ids_fn, default_max)
        if not st.aeng.alive:
            raise APIError(503, "engine thread is not running", type_="server_error")
        if st.engine.num_waiting >= st.max_queue:
            raise APIError(429, f"server is busy: {st.engine.num_waiting} requests are already waiting "
                                f"(limit {st.max_queue}); retry later", type_="rate_limit_exceeded")
        rid = new_id("chatcmpl" if chat else "cmpl")
        try:
            q = st.aeng.add(rid, req.prompt_ids, req.params)
        except RequestError as e:
            raise APIError(400, str(e)) from None
    except APIError as e:
        return err(st, e)
    st.metrics.prompt_tokens.inc(len(req.prompt_ids))
    stop_ids = set(req.params.stop_token_ids) | ({st.eos} if st.eos is not None and not req.params.ignore_eos else set())
    tr = Tracker(st, arrival, stop_ids)
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now(),
            "model": st.name}
    if req.stream:
        return StreamingResponse(stream(st, rid, q, tr, req, base, chat), media_type="text/event-stream")
    return await collect(st, request, rid, q, tr, req, base, chat)


def _choice(chat: bool, text: str | None, finish, stream: bool, token_ids=None) -> dict:
    c = {"index": 0}
    if chat:
        c["delta" if stream else "message"] = ({"content": text} if stream else {"role": "assistant", "content": text})
    else:
        c["text"] = text
    c["logprobs"] = None
    c["finish_reason"] = finish
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


async def stream(st, rid, q, tr: Tracker, req, base, chat):
    finished = failed = False
    try:
        if chat:  # OpenAI opens a chat stream with the role
            yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], "usage": None})
        while True:
            stamp, out = await q.get()
            if isinstance(out, EngineStepError):
                st.metrics.error(500)
                failed = True
                yield sse(error_body(str(out), "server_error"))
                break
            delta = tr.update(stamp, out)
            new = out.new_token_ids if req.return_token_ids else None
            yield sse({**base, "choices": [_choice(chat, delta, out.finish_reason, True, new)], "usage": None})
            if out.finished:
                finished = True
                break
        if finished and req.include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(req.prompt_ids), len(tr.ids))})
        yield "data: [DONE]\n\n"
    finally:  # runs on normal end, on error and when the client disconnects (task cancelled)
        _cleanup(st, rid, finished, failed)


def _cleanup(st, rid, finished: bool, failed: bool) -> None:
    if not finished:
        st.aeng.abort(rid)
        if not failed:  # the client went away
            st.metrics.success("abort")
    st.aeng.release(rid)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(st, request, rid, q, tr: Tracker, req, base, chat):
    finished = failed = False
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(q.get())
            done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # client went away: nobody to answer
                get.cancel()
                return Response(status_code=499)
            stamp, out = get.result()
            if isinstance(out, EngineStepError):
                failed = True
                return err(st, APIError(500, str(out), type_="server_error"))
            tr.update(stamp, out)
            if out.finished:
                finished = True
                break
    finally:
        watcher.cancel()
        _cleanup(st, rid, finished, failed)
    text = st.tokenizer.decode(tr.text_ids())
    body = {**base, "object": "chat.completion" if chat else "text_completion",
            "choices": [_choice(chat, text, tr.finish_reason, False, tr.ids if req.return_token_ids else None)],
            "usage": usage(len(req.prompt_ids), len(tr.ids))}
    return body


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
