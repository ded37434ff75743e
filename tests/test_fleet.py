"""Many replicas behind vLLM's own router (vllm-router, a pinned test dependency: its Rust binary), on the CPU.

Three `peregrine serve --model peregrine-tiny` replicas publishing KV cache events, and a fourth that serves the
same agent-shaped sessions alone (each turn re-sends the whole conversation plus a new task). Shown:
- kv_aware (--kv-event-source per replica) keeps the fleet's prefix-cache hit rate (prefix_cache_hits /
  prefix_cache_queries summed over the replicas' /metrics) at >= 97 % of the single replica's on the same
  sessions, cache_aware at >= 90 %, and round_robin, measured beside them, lower;
- every session's answers (greedy and seeded sampling) equal the single replica's;
- a replica killed mid-load: every request in flight on it ends (an error or an answer, never a hang), every
  request sent after the kill is answered; restarted, it answers /health 503 while it loads, rejoins and gets
  traffic again;
- a drain loses nothing: SIGTERM one replica under load through the router, with cache_aware and with kv_aware:
  0 failed requests (every answer the single replica's, also the turns the router still sent the draining replica
  before its health check dropped it), the requests in flight on it finish (streamed and not), /health answers 503
  or refuses and never 200 while it drains, and it exits 0.
Each policy's sessions carry their own salt, so no run finds another's blocks; the single replica serves each
salt's sessions too and is the reference of both the hit rate and the answers. No assertion depends on machine
speed: every wait is bounded by a generous limit.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

MODEL = "peregrine-tiny"
BLOCK = 64          # peregrine-tiny's KV block size (/get_server_info kv_block_size)
LIMIT = 120.0       # generous bound on any one wait
GRACE = 10.0        # --drain-grace: a draining replica serves what still comes until none has for this long, well
                    # over the 3 health checks 1 s apart after which the drain phase's router stops sending it work
SESSIONS, TURNS, PARALLEL = 6, 5, 3
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def _router_runs() -> str | None:
    if not os.path.exists(ROUTER):
        return "vllm-router is not installed (pip install -r requirements-cpu.txt pins vllm-router==0.1.17)"
    try:
        r = subprocess.run([ROUTER, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"vllm-router cannot run here: {e}"
    if r.returncode != 0 or "--kv-event-source" not in r.stdout:
        return f"vllm-router --help failed or has no --kv-event-source (exit {r.returncode}): {r.stderr[-300:]}"
    return None


pytestmark = pytest.mark.skipif(bool(_router_runs()), reason=_router_runs() or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One `peregrine serve` process on fixed ports (a restart reuses them)."""

    def __init__(self, name: str, events: bool):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ev_port = free_port() if events else None
        self.proc: subprocess.Popen | None = None
        self.log = b""

    @property
    def events_at(self) -> str:
        return f"tcp://127.0.0.1:{self.ev_port}"

    def start(self, health_trace: list | None = None) -> None:
        args = [sys.executable, "-m", "peregrine.server", "serve", "--model", MODEL, "--port", str(self.port),
                "--max-num-seqs", "4", "--log-level", "warning", "--drain-timeout", "60",
                "--drain-grace", str(GRACE)]
        if self.ev_port:
            args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": f"tcp://*:{self.ev_port}"})]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + LIMIT
        while True:
            try:
                code = httpx.get(self.url + "/health", timeout=2).status_code
                if health_trace is not None:
                    health_trace.append(code)
                if code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, f"{self.name} exited: {self.log[-3000:].decode(errors='replace')}"
            assert time.monotonic() < deadline, f"{self.name} did not come up"
            time.sleep(0.01)

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.log += line

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("peregrine:") and " " in line:
                k, v = line.rsplit(" ", 1)
                out[k] = out.get(k, 0.0) + float(v)
        return out


def cache_counts(replicas) -> tuple[float, float]:
    q = h = 0.0
    for r in replicas:
        m = r.metrics()
        q += m.get("peregrine:prefix_cache_queries_total", 0.0)
        h += m.get("peregrine:prefix_cache_hits_total", 0.0)
    return q, h


def served(r: Replica) -> float:
    return sum(v for k, v in r.metrics().items() if k.startswith("peregrine:request_success_total"))


class Router:
    def __init__(self, policy: str, replicas: list[Replica], log_level: str = "warning", health_failures: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                "--worker-urls", *[r.url for r in replicas],
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--health-check-interval-secs", "1", "--health-failure-threshold", str(health_failures),
                "--health-success-threshold", "1", "--health-check-timeout-secs", "5",
                "--request-timeout-secs", str(int(LIMIT)), "--log-level", log_level]
        if policy == "kv_aware":
            for r in replicas:
                args += ["--kv-event-source", f"{r.url}={r.events_at}"]
            args += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.log = b""
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + LIMIT
        while True:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, f"vllm-router exited: {self.log[-3000:].decode(errors='replace')}"
            assert time.monotonic() < deadline, "vllm-router did not come up"
            time.sleep(0.1)
        time.sleep(1.0)  # its KV event subscribers connect

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log += line

    def credited(self) -> list[int]:
        """kv_aware's decisions (its debug log): the prefix tokens it credited the replica it chose, per request."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.decode(errors="replace"))
        return [int(m) for m in re.findall(r"KV prefix decision .*?credited_prefix_tokens=(\d+)", text)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ---- agent-shaped sessions ----
# peregrine-tiny's chat template shows the model only the last user message, so a session is a raw-prompt
# transcript on /v1/completions: each turn sends every earlier turn's task and answer, then a new task.
def tasks(rng: random.Random, salt: str, turn: int) -> str:
    """A turn's new text: a key-value recall task (~90 bytes), the first turn opening with the session's salt."""
    keys = ["".join(rng.choice("abcdefghij") for _ in range(4)) for _ in range(8)]
    vals = ["".join(rng.choice("0123456789") for _ in range(4)) for _ in range(8)]
    ask = rng.randrange(8)
    head = f"{salt}|" if turn == 0 else ""
    return head + "kv:" + ";".join(f"{k}:{v}" for k, v in zip(keys, vals)) + f";?{keys[ask]}="


def session_spec(salt: str, i: int) -> dict:
    sampled = i % 2 == 1
    return {"salt": f"{salt}-{i}", "seed": 1000 + i, "sampled": sampled}


def run_session(base: str, spec: dict, stream: bool = False, retries: int = 0, log: list | None = None,
                before_turn=None) -> list[str]:
    """The session's turns in order against `base`; -> the answers. A turn that fails is sent again (an agent
    retries) at most `retries` times; every attempt is logged (status, sent at). before_turn(t) runs before turn t."""
    rng = random.Random(spec["salt"])
    prompt, answers = "", []
    with httpx.Client(timeout=LIMIT) as c:
        for t in range(TURNS):
            if before_turn is not None:
                before_turn(t)
            prompt += tasks(rng, spec["salt"], t)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                    "temperature": 0.8 if spec["sampled"] else 0.0, "seed": spec["seed"] + t}
            for attempt in range(retries + 1):
                sent = time.monotonic()
                ok, text = _ask(c, base, body, stream)
                if log is not None:
                    log.append({"ok": ok, "sent": sent, "done": time.monotonic(), "session": spec["salt"], "turn": t,
                                "error": None if ok else text[:200]})
                if ok:
                    break
            assert ok, f"turn {t} of {spec['salt']} failed {retries + 1} time(s): {text}"
            answers.append(text)
            prompt += text + "\n"
    return answers


def _ask(c: httpx.Client, base: str, body: dict, stream: bool) -> tuple[bool, str]:
    """(answered, text or the error). A stream that ends without its finish_reason and [DONE] is an error."""
    if not stream:
        r = c.post(base + "/v1/completions", json=body)
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {r.text[:300]}"
        return True, r.json()["choices"][0]["text"]
    text, finished, done = "", False, False
    try:
        with c.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}: {r.read()[:300]!r}"
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        return False, f"stream error: {ev['error']}"
                    for ch in ev.get("choices", []):
                        text += ch.get("text") or ""
                        finished |= ch.get("finish_reason") is not None
    except httpx.TransportError as e:
        return False, f"stream cut: {type(e).__name__}"
    return (finished and done), (text if finished and done else "stream ended without finish_reason / [DONE]")


def run_all(base: str, specs: list[dict], **kw) -> dict[str, list[str]]:
    with ThreadPoolExecutor(PARALLEL) as ex:
        futs = {s["salt"]: ex.submit(run_session, base, s, **kw) for s in specs}
        return {k: f.result(timeout=10 * LIMIT) for k, f in futs.items()}


def test_fleet_behind_vllm_router():
    """One test, so that one worker of the test command starts the four replicas (once)."""
    single = Replica("single", events=False)
    reps = [Replica(n, events=True) for n in "ABC"]
    try:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda r: r.start(), [single, *reps]))
        policies_hit_rate_and_answers((single, reps))
        kill_and_restart((single, reps))
        drain_loses_nothing((single, reps))
    finally:
        for r in [single, *reps]:
            r.stop()


def hit_rate(q0, h0, q1, h1) -> float:
    assert q1 > q0, "no prefix-cache queries were counted"
    return (h1 - h0) / (q1 - q0)


def policies_hit_rate_and_answers(fleet):
    """kv_aware >= 97 % of one replica's prefix-cache hit rate, cache_aware >= 90 %, round_robin lower; every
    answer equal to the single replica's."""
    single, reps = fleet
    rates, report = {}, []
    for policy in ("kv_aware", "cache_aware", "round_robin"):
        specs = [session_spec(f"{policy}-{random.Random(policy).randrange(10**6)}", i) for i in range(SESSIONS)]
        q0, h0 = cache_counts([single])
        ref = run_all(single.url, specs)
        q1, h1 = cache_counts([single])
        router = Router(policy, reps, log_level="debug" if policy == "kv_aware" else "warning")
        try:
            fq0, fh0 = cache_counts(reps)
            got = run_all(router.url, specs, stream=(policy == "cache_aware"))
            fq1, fh1 = cache_counts(reps)
        finally:
            router.stop()
        if policy == "kv_aware":  # it routed by the events: what it credited is what the replicas reused
            credited = router.credited()
            assert len(credited) == SESSIONS * TURNS, router.log[-3000:]
            assert sum(credited) == fh1 - fh0 > 0, (credited, fh1 - fh0)
        assert got == ref, f"{policy}: answers differ from the single replica's"
        one, many = hit_rate(q0, h0, q1, h1), hit_rate(fq0, fh0, fq1, fh1)
        rates[policy] = many / one
        report.append(f"{policy}: fleet {many:.3f} vs one replica {one:.3f} ({rates[policy]:.2f}x)")
    print("\n".join(report))
    assert rates["kv_aware"] >= 0.97, report
    assert rates["cache_aware"] >= 0.90, report
    assert rates["round_robin"] < min(rates["kv_aware"], rates["cache_aware"]), report


def kill_and_restart(fleet):
    """A replica killed mid-load; restarted (503 while it loads), it rejoins."""
    single, reps = fleet
    specs = [session_spec(f"kill-{random.Random(7).randrange(10**6)}", i) for i in range(SESSIONS)]
    ref = run_all(single.url, specs)
    router = Router("kv_aware", reps)
    victim = reps[1]
    try:
        attempts: list[dict] = []
        got: dict[str, list[str]] = {}
        before = served(victim)
        with ThreadPoolExecutor(PARALLEL) as ex:
            futs = {s["salt"]: ex.submit(run_session, router.url, s, stream=(i % 2 == 0), retries=2, log=attempts)
                    for i, s in enumerate(specs)}
            deadline = time.monotonic() + LIMIT  # kill it once it has served a few requests of this load
            while served(victim) < before + 2:
                assert time.monotonic() < deadline, "the victim got no traffic"
                time.sleep(0.05)
            killed_at = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(30)
            for k, f in futs.items():
                got[k] = f.result(timeout=10 * LIMIT)  # every turn ended: nothing hung
        assert got == ref, "answers after the kill differ from the single replica's"
        after = [a for a in attempts if a["sent"] > killed_at]
        assert after and all(a["ok"] for a in after), \
            f"requests sent after the kill failed: {[a for a in after if not a['ok']]}"
        in_flight = [a for a in attempts if a["sent"] <= killed_at < a["done"]]
        print(f"kill: {len(in_flight)} in flight (errors: {[a['error'] for a in in_flight if not a['ok']]}), "
              f"{len(after)} sent after it, all answered")

        # restart: /health answers 503 while the model loads; the router keeps it out until then
        trace: list[int] = []
        stop = threading.Event()
        failures: list[str] = []

        def load_through_router():
            i = 0
            while not stop.is_set():
                spec = session_spec(f"during-restart-{i}", i)
                try:
                    run_session(router.url, spec)
                except AssertionError as e:
                    failures.append(str(e))
                i += 1
        t = threading.Thread(target=load_through_router)
        t.start()
        try:
            victim.start(health_trace=trace)
        finally:
            stop.set()
            t.join(LIMIT)
        assert 503 in trace and trace[-1] == 200, f"/health while loading: {trace}"
        assert not failures, f"requests failed while the replica restarted: {failures}"
        # it rejoins: new sessions reach it again
        before = served(victim)
        deadline = time.monotonic() + LIMIT
        i = 0
        while served(victim) == before:
            assert time.monotonic() < deadline, "the restarted replica got no traffic"
            run_all(router.url, [session_spec(f"rejoin-{i}", j) for j in range(PARALLEL)])
            i += 1
        print(f"restart: /health answered 503 {trace.count(503)} times, then 200; it got traffic again")
    finally:
        router.stop()


def long_request(url: str, stream: bool) -> int:
    """A 300-token request straight to one replica; -> its completion tokens (a stream must end with [DONE])."""
    body = {"model": MODEL, "prompt": "copy:" + "peregrine" * 10 + "|", "max_tokens": 300, "ignore_eos": True,
            "temperature": 0}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=LIMIT)
        assert r.status_code == 200, r.text[:300]
        return r.json()["usage"]["completion_tokens"]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=LIMIT) as r:
        assert r.status_code == 200, r.read()[:300]
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and all('"error"' not in line for line in lines), lines[-3:]
    return json.loads(lines[-2][6:])["usage"]["completion_tokens"]


def poll_health(r: Replica, out: list) -> None:
    """/health on a new connection each time until the process exits: the status, or "refused" once it stops
    listening."""
    while r.proc.poll() is None:
        try:
            out.append(httpx.get(r.url + "/health", timeout=5).status_code)
        except httpx.HTTPError:
            out.append("refused")
        time.sleep(0.05)


def drain_loses_nothing(fleet):
    """SIGTERM a replica under load through the router, with cache_aware and with kv_aware: 0 failed requests
    (every answer the single replica's), its requests in flight finish, /health never 200 while it drains, exit 0.
    This router drops a replica after 3 failed health checks 1 s apart, so for ~2 s after the signal it still routes
    there: a session that lives on the replica sends its next turns right after SIGTERM, then fresh sessions start;
    those are the requests a drain must not lose. (vllm-router retries a refused request on the replica its policy
    picks: with cache_aware the same one, 5 times in ~0.4 s, so a replica that answered 503 at once lost the
    session's next turn.)"""
    single, reps = fleet
    for policy in ("cache_aware", "kv_aware"):
        salt = f"drain-{policy}-{random.Random(policy).randrange(10**6)}"
        specs = [session_spec(salt, i) for i in range(SESSIONS)]
        pinned = session_spec(f"{salt}-pinned", 0)
        ref, ref_pinned = run_all(single.url, specs), run_session(single.url, pinned)
        router = Router(policy, reps, health_failures=3)
        attempts: list[dict] = []
        health: list = []
        box: dict = {}
        load, side = ThreadPoolExecutor(PARALLEL), ThreadPoolExecutor(3)
        try:
            def sigterm(turn):
                """Before the pinned session's third turn: SIGTERM the replica that served its second, with two long
                requests in flight on it; before its fourth, fresh sessions start through the router."""
                if turn == 1:
                    box["before"] = {r.name: served(r) for r in reps}
                elif turn == 2:
                    after = {r.name: served(r) for r in reps}
                    victim = box["victim"] = max(reps, key=lambda r: after[r.name] - box["before"][r.name])
                    box["long"] = [side.submit(long_request, victim.url, stream) for stream in (False, True)]
                    deadline = time.monotonic() + LIMIT
                    while victim.metrics().get("peregrine:num_requests_running", 0) < 2:
                        assert time.monotonic() < deadline, "the long requests did not start"
                        time.sleep(0.02)
                    box["mark"] = len(victim.log)
                    victim.proc.send_signal(signal.SIGTERM)
                    box["poll"] = side.submit(poll_health, victim, health)
                elif turn == 3:
                    box["load"] = {s["salt"]: load.submit(run_session, router.url, s, stream=(i % 2 == 0),
                                                          log=attempts) for i, s in enumerate(specs)}
            got_pinned = run_session(router.url, pinned, log=attempts, before_turn=sigterm)
            got = {k: f.result(timeout=10 * LIMIT) for k, f in box["load"].items()}
            victim = box["victim"]
            assert victim.proc.wait(LIMIT) == 0
            box["poll"].result(LIMIT)
            assert [f.result(LIMIT) for f in box["long"]] == [300, 300], "a request in flight did not finish"
        finally:
            router.stop()
            load.shutdown(wait=False, cancel_futures=True)
            side.shutdown(wait=False, cancel_futures=True)
        failed = [a for a in attempts if not a["ok"]]
        assert not failed, f"{policy}: {len(failed)} of {len(attempts)} requests failed over the drain: {failed}"
        assert got == ref and got_pinned == ref_pinned, f"{policy}: answers differ from the single replica's"
        assert 503 in health and 200 not in health, f"/health while draining: {health}"
        deadline = time.monotonic() + LIMIT
        while b"drained: exiting" not in victim.log[box["mark"]:]:  # its last line, read by a thread
            assert time.monotonic() < deadline, victim.log[-2000:]
            time.sleep(0.05)
        late = re.search(rb"drained: exiting \((\d+) request", victim.log[box["mark"]:])
        print(f"drain ({policy}): {len(attempts)} requests through the router, none failed; the draining replica "
              f"served {late.group(1).decode() if late else '?'} that arrived after SIGTERM; /health 503 "
              f"x{health.count(503)}, then refused x{health.count('refused')}")
        victim.start()  # back in the fleet for the next policy
