"""Test setup: kernels run under the Triton interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, hence here.
On a GPU machine the same tests compile for real; `pytest -m gpu` selects the
kernel and device tests, and FULL_SHAPES widens them to every real shape.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one thread per xdist worker (the test command runs -n 2 on 2 cores: more threads oversubscribe them)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# CI (CPU, interpreter) runs a representative subset of shapes; the GPU pass runs them all.
FULL_SHAPES = DEVICE == "cuda" or os.environ.get("PEREGRINE_FULL_SHAPES") == "1"


def run_aot(script: str, timeout: int = 300):
    """Run `script` in a fresh Python without the interpreter, where it compiles kernels ahead of time
    for sm_90a (no GPU needed), and return the JSON its last output line prints. Skips where triton
    ships no ptxas or has no ahead-of-time compile API."""
    import json
    import subprocess
    import sys
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")):
        pytest.skip("triton's ptxas is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    missing = ("ImportError" in r.stderr or "ModuleNotFoundError" in r.stderr) and (
        "GPUTarget" in r.stderr or "ASTSource" in r.stderr)  # only a missing API: a compile error's traceback names them too
    if r.returncode != 0 and missing:
        pytest.skip("no ahead-of-time compile API in this triton")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


LM_HEAD_SHARPEN = 4.0  # dummy lm_head x4: confident greedy choices, as a trained model has


def dummy_model_dir(tmp_path_factory, raw: dict, name: str, seed: int) -> str:
    """A model folder (config.json + safetensors) with seeded FP32 dummy weights and a sharpened lm_head."""
    return write_dummy_model(tmp_path_factory.mktemp(name), raw, seed)


def write_dummy_model(d, raw: dict, seed: int | None) -> str:
    """config.json into folder d, and with a seed its FP32 dummy weights (lm_head sharpened)."""
    import json
    from peregrine.config import ModelConfig
    from peregrine.models.kimi import KimiModel
    from peregrine.models.loader import init_dummy_weights, save_weights
    (d / "config.json").write_text(json.dumps(raw))
    if seed is None:
        return str(d)
    m = KimiModel(ModelConfig.from_dict(raw), torch.float32)
    init_dummy_weights(m, seed=seed)
    for pname, view, _ in m.hf_params():
        if pname.endswith("lm_head.weight"):
            view.mul_(LM_HEAD_SHARPEN)
    save_weights(m, d)
    return str(d)


@pytest.fixture
def no_build(monkeypatch):
    """CLI tests of bad arguments: building the model before checking them fails the test."""
    import peregrine.engine.build as build

    def built(*a, **k):
        raise AssertionError("the model was built before the arguments were checked")
    monkeypatch.setattr(build, "build_engine", built)


@pytest.fixture
def device():
    return DEVICE


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: kernel/device tests; CPU runs them under the Triton interpreter, the GPU pass compiled")
    config.addinivalue_line("markers", "slow: long CPU tests, skipped unless PEREGRINE_SLOW=1 or -m names slow")


def pytest_collection_modifyitems(config, items):
    """CI runs plain `pytest -q`: slow tests stay out of it unless asked for."""
    if os.environ.get("PEREGRINE_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with PEREGRINE_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def start_server(args: list[str], timeout: float = 120.0, env: dict | None = None, log=None):
    """`python -m peregrine.server serve ARGS --port P` on a free loopback port, once /health answers.
    -> (process, base url); the caller ends the process. log: a Path its output goes to (else a pipe), whose tail
    a failed start shows."""
    import socket
    import subprocess
    import sys
    import time

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the test command's workers fill the cores: a server with torch's
        env.setdefault("OMP_NUM_THREADS", "1")  # default threads beside them ran its soak 4x slower (oversubscribed)
    out = log.open("wb") if log is not None else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "peregrine.server", "serve", *args, "--port", str(port)],
                            stdout=out, stderr=subprocess.STDOUT, env=env)
    if log is not None:
        out.close()  # the child holds its own copy
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError("server did not come up" + (f": {log.read_text()[-3000:]}" if log is not None else ""))
        time.sleep(0.2)
