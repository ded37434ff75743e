"""The engine in its own thread beside the event loop.

The thread steps while any request is unfinished and otherwise sleeps on an
Event that add() sets. Tokens travel back through the engine's on_token
callback, which hands (timestamp, output) to the request's asyncio.Queue with
loop.call_soon_threadsafe. A failure the engine pins on one request arrives as
that request's output (finish_reason "error"); a step that still raises fails
every in-flight request with an EngineStepError (logged with its traceback) and
the thread keeps serving. after_step (if given) runs on the thread after each step: the KV event
publisher takes the step's cache events there. cut(message) fails every in-flight request with a
ShutdownError (a drain that ran out of time).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # wake-up period when idle: only bounds how fast stop() is noticed


class EngineStepError(RuntimeError):
    """Put on a request's queue when the engine step serving it raised."""


class ShutdownError(EngineStepError):
    """Put on a request's queue when the server stops before the request finished (a 503)."""


class AsyncEngine:
    def __init__(self, engine, on_step_error=None, after_step=None):
        self.engine = engine
        self.on_step_error = on_step_error
        self.after_step = after_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- event-loop side ----
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="peregrine-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add(self, request_id: str, prompt_ids: list[int], params, queue: asyncio.Queue | None = None,
            forced: list[int] | None = None) -> asyncio.Queue:
        """Queue a request; its outputs arrive on the returned queue (`queue`: one shared by several
        requests, e.g. the n choices of one API call; outputs carry their request_id). forced (benchmarks
        only): the tokens it emits (engine.forced). Raises RequestError."""
        loop, q = asyncio.get_running_loop(), queue if queue is not None else asyncio.Queue()
        with self._lock:
            self._queues[request_id] = (loop, q)

        def on_token(out, loop=loop, q=q):
            try:
                loop.call_soon_threadsafe(q.put_nowait, (time.perf_counter(), out))
            except RuntimeError:  # loop closed: nobody listens any more
                pass
        try:
            if forced is None:
                self.engine.add_request(prompt_ids, params, request_id=request_id, on_token=on_token)
            else:
                self.engine.add_request(prompt_ids, params, request_id=request_id, on_token=on_token, forced=forced)
        except BaseException:
            self.release(request_id)
            raise
        self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        done = self.engine.abort(request_id)
        self._wake.set()
        return done

    def release(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and join the thread."""
        with self._lock:
            rids = list(self._queues)
        for rid in rids:
            self.engine.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread ----
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:
                log.exception("engine step failed; failing the in-flight requests")
                self._fail_all(e)
            if self.after_step is not None:
                try:
                    self.after_step()
                except Exception:
                    log.exception("after-step hook failed")

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._queues)

    def cut(self, message: str) -> int:
        """Fail every in-flight request with a ShutdownError and abort it; -> how many."""
        with self._lock:
            items = list(self._queues.items())
        err = ShutdownError(message)
        for rid, (loop, q) in items:
            try:
                loop.call_soon_threadsafe(q.put_nowait, (time.perf_counter(), err))
            except RuntimeError:
                pass
            self.engine.abort(rid)
        self._wake.set()
        return len(items)

    def _fail_all(self, exc: Exception) -> None:
        if self.on_step_error is not None:
            self.on_step_error(exc)
        with self._lock:
            items = list(self._queues.items())
        err = EngineStepError(f"engine step failed: {type(exc).__name__}: {exc}")
        for rid, (loop, q) in items:
            try:
                loop.call_soon_threadsafe(q.put_nowait, (time.perf_counter(), err))
            except RuntimeError:
                pass
            self.engine.abort(rid)  # frees its slot and blocks
