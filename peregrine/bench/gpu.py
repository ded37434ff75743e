"""Measurement primitives shared by every benchmark: the same-run copy
bandwidth (the roofline ceiling), CUDA-event timing, and run metadata."""
from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

COPY_BYTES = 2 << 30  # 2 GiB source: far past the 60 MB L2, so the copy streams HBM


def kernel_resources(jit_fn, key_chars: int = 160) -> dict:
    """Registers / spills of every compiled variant of a Triton kernel (ptxas), keyed by its constexprs."""
    out = {}
    try:
        for caches in jit_fn.device_caches.values():
            for key, k in caches[0].items():
                out[str(key)[:key_chars]] = {"n_regs": k.n_regs, "n_spills": k.n_spills}
    except Exception as e:  # noqa: BLE001 - triton internals differ between versions
        out["error"] = f"{type(e).__name__}: {e}"[:160]
    return out


def time_fn(fn, iters: int = 50, warmup: int = 10) -> list[float]:
    """Per-call times in ms, each from its own pair of CUDA events (after warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def graph_time(calls, iters: int = 30) -> tuple[float, list[float]]:
    """Capture `calls` in one CUDA graph; returns (median ms per call, samples ms per call)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:3]:  # compile + allocator warm-up outside capture
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    samples = [t / len(calls) for t in time_fn(g.replay, iters=iters, warmup=3)]
    del g
    return statistics.median(samples), samples


def copy_bandwidth(nbytes: int = COPY_BYTES, iters: int = 20) -> dict:
    """Device-to-device copy, counting bytes read + written. Returns GB/s (1e9) and samples."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), iters=iters, warmup=3)
    med = statistics.median(ms)
    del src, dst
    torch.cuda.empty_cache()
    return {"gbps": 2 * nbytes / (med * 1e-3) / 1e9, "bytes": 2 * nbytes, "samples_ms": ms}


def git_commit() -> str:
    """PEREGRINE_COMMIT when set (device runs: `export PEREGRINE_COMMIT=$(cat .commit)`, since the
    device copy's git metadata can be stale), else HEAD (+ "-dirty"), else .commit."""
    import os
    import re
    if os.environ.get("PEREGRINE_COMMIT"):
        return os.environ["PEREGRINE_COMMIT"] + " (PEREGRINE_COMMIT)"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
        if re.fullmatch(r"[0-9a-f]{40}", sha):
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=5).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except Exception:
        pass
    try:
        return Path(".commit").read_text().strip() + " (from .commit)"
    except OSError:
        return "unknown"


def run_metadata() -> dict:
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "command": " ".join(sys.argv),
        "commit": git_commit(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": tv,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def gpu_slug() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return name.lower().replace("nvidia ", "").replace(" ", "-")


def result_path(model: str, what: str, results_dir: str | Path = "results") -> Path:
    date = _dt.date.today().isoformat()
    return Path(results_dir) / f"{date}-{gpu_slug()}-{model}-{what}.json"


def write_result(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def family_main(family: str, run, line, header: str | None = None, doc: str | None = None) -> None:
    """A kernel family's own command (`python -m peregrine.bench.kernels_<family> [--quick]`): its rows
    from run(copy_gbps, full) against the copy bandwidth measured in the same run, written under
    results/, and `line(row)` printed per row."""
    import argparse
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    rows = run(copy["gbps"], full=not a.quick)
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    path = write_result(result_path("kernels", family, a.results_dir), {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s")
    if header:
        print(header)
    for r in rows:
        print(line(r))
    print(f"-> {path}")
