"""Host memory: the process's resident size, what glibc's allocator keeps, and giving it back.

Why (issue #47): glibc's malloc serves a freed large block's size from its heap afterwards (the
mmap threshold rises to the largest block freed, up to 32 MiB), and a heap only shrinks from its
top. Tensors of changing sizes (a CPU forward's activations, per-step host tensors) then leave
free holes that stay resident: measured on peregrine-tiny, 32-request waves of the engine took
RSS 389 -> 1 704 MB while live tensors stayed ~100 MB. malloc_trim(0) hands every free page of
every arena back (madvise), so the engine calls it between steps, at most every TRIM_PERIOD_S
under load and once when it goes idle: RSS then held at 421-434 MB over the same waves. The price
is page faults when given-back pages are reused (~8 % of a CPU engine's time, where activations are
host memory; a fixed mmap threshold, the other cure, cost ~50 %).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

TRIM_PERIOD_S = 1.0  # under load: one trim a second (24 ms at worst measured on CPU, after 6 untrimmed waves)
TRIM_ENV = "PEREGRINE_MALLOC_TRIM_S"  # seconds between trims; 0 turns trimming off (A/B runs)


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.malloc_trim  # glibc only: musl and macOS have none
    except (OSError, AttributeError):
        return None
    lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lib


_LIBC = _libc()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc), None where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def malloc_info() -> dict | None:
    """glibc's own account (mallinfo2, glibc >= 2.33), main arena + others: heap bytes it holds
    ('heap'), in use by the program ('in_use'), free but kept ('free_kept'), mmapped blocks ('mmapped')."""
    fn = getattr(_LIBC, "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {"heap": m.arena, "in_use": m.uordblks, "free_kept": m.fordblks, "mmapped": m.hblkhd,
            "top_releasable": m.keepcost}


def trim_period() -> float:
    v = os.environ.get(TRIM_ENV)
    if v is None:
        return TRIM_PERIOD_S
    try:
        p = float(v)
    except ValueError:
        raise ValueError(f"{TRIM_ENV} must be a number of seconds (0 = off), got {v!r}") from None
    if p < 0:
        raise ValueError(f"{TRIM_ENV} must be >= 0 seconds (0 = off), got {v!r}")
    return p


class Trimmer:
    """Gives glibc's free pages back between engine steps: after_step() at most once a period while
    busy, and once when the engine has nothing left to run."""

    def __init__(self, period: float | None = None):
        self.period = trim_period() if period is None else period
        self.enabled = _LIBC is not None and self.period > 0
        self._last = time.monotonic()
        self._dirty = False  # steps since the last trim
        self.stats = {"trims": 0, "seconds": 0.0}

    def after_step(self, idle: bool) -> None:
        if not self.enabled:
            return
        self._dirty = True
        now = time.monotonic()
        if idle or now - self._last >= self.period:
            self.trim(now)

    def trim(self, now: float | None = None) -> None:
        if not (self.enabled and self._dirty):
            return
        t0 = time.perf_counter()
        _LIBC.malloc_trim(0)
        self.stats["trims"] += 1
        self.stats["seconds"] += time.perf_counter() - t0
        self._last, self._dirty = (now if now is not None else time.monotonic()), False
