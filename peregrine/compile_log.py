"""Triton compiles while serving. A fresh machine's first requests pay for every kernel specialization the
server's start-up warm-up did not compile (a first eight-prompt step of ~1.7 s against ~0.17 s warm at
5ec7707, results/README.md session 10). With PEREGRINE_LOG_COMPILES=1 the server counts the compiles of its
start-up and logs each later one (the kernel, its specialization, seconds) as a warning.
"""
from __future__ import annotations

import os
import time

ENV = "PEREGRINE_LOG_COMPILES"
_state = {"on": False, "serving": False, "startup": 0, "later": 0, "started": {}, "log": print}


def _before(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (triton's names)
    _state["started"][key] = time.perf_counter()
    return None  # a true value would make triton skip the compile


def _after(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
    t0 = _state["started"].pop(key, None)
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    if not _state["serving"]:
        _state["startup"] += 1
        return None
    _state["later"] += 1
    _state["log"](f"WARNING: triton compiled {fn.name} while serving ({secs:.2f}s; the warm-up missed it): "
                  f"{describe(compile) or repr[:400]}")
    return None


def describe(compile: dict) -> str:
    """The specialization that made this compile, from the hook's compile record: the arguments fixed as
    constants (ints equal to 1 among them) and those taken as 16-divisible / 16-byte aligned. Triton's own
    `repr` lists only the first argument in 3.6 (it zips the names with a string key)."""
    try:
        names = list(compile["signature"])
        const = ", ".join(f"{names[p[0]]}={v}" for p, v in sorted(compile.get("constants", {}).items()) if len(p) == 1)
        attrs = compile.get("configs") or [{}]
        div = ", ".join(names[p[0]] for p in sorted(attrs[0]) if len(p) == 1)
        ptrs = ", ".join(f"{n}: {t}" for n, t in compile["signature"].items() if str(t).startswith("*"))
        return f"constants [{const}]; divisible by 16 [{div}]; pointers [{ptrs}]"[:1500]
    except Exception:  # a triton whose record differs: its repr
        return ""


def install(log, env=None) -> bool:
    """Hook triton's compiles when the environment asks for it (ENV=1); whether the hooks are on."""
    if (env if env is not None else os.environ).get(ENV) != "1":
        return False
    try:
        from triton import knobs
    except Exception:  # no triton, or one without the runtime hooks: nothing compiles that we could see
        return False
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = _before, _after
    _state.update(on=True, serving=False, startup=0, later=0, log=log)
    return True


def serving() -> None:
    """The start-up is over: say how many kernels it compiled; later compiles are logged one by one."""
    if _state["on"] and not _state["serving"]:
        _state["serving"] = True
        _state["log"](f"{_state['startup']} Triton kernel specializations compiled at start-up; any later one is logged")


def counts() -> dict:
    return {"startup": _state["startup"], "serving": _state["later"]}
