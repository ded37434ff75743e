"""Process launch: one process per rank, torch.distributed with NCCL on GPUs
(gloo on CPU), plus a gloo group for rank 0's step messages.

Two ways in: `--tensor-parallel-size N` from the CLI spawns ranks 1..N-1 from the
main process (which is rank 0); under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set,
any number of nodes) every process joins from the environment. Either way the
NVLink-multicast switches below are set before any NCCL or CUDA initialisation:
the lent machines need multicast off.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
from datetime import timedelta

import torch

from ..config import ConfigError
from .group import TPGroup

NVLINK_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT = timedelta(minutes=10)  # a collective may wait this long for a peer (graph captures, weight init)
IDLE_TIMEOUT = timedelta(days=30)  # the control group: an idle server's ranks wait for rank 0's next step

PARENT_POLL_S = 1.0  # how often a spawned rank checks that rank 0 still runs
TEARDOWN_S = 20.0    # longest wait for the group's teardown and each rank's exit: quitting never hangs

_state: dict = {"tp": None, "procs": []}


def set_env() -> None:
    """Every rank keeps NVLink multicast off (set here, not by hand)."""
    os.environ.update(NVLINK_OFF_ENV)


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world: int, local_rank: int, device_type: str, init_method: str) -> TPGroup:
    import torch.distributed as dist
    set_env()
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT,
                                device_id=device)
        ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        x = torch.ones(1, device=device)
        dist.all_reduce(x)  # make the communicator now: CUDA graph capture must not be its first use
        torch.cuda.synchronize()
    else:
        device = torch.device("cpu")
        if rank:  # ranks on one CPU share its cores (rank 0 is the caller's process: left as it is)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=IDLE_TIMEOUT)
        ctrl = None  # the default (gloo) group carries the control messages too
    return TPGroup(rank, world, device, group=None, ctrl=ctrl)


def _exit_with_parent(parent: int) -> None:
    """A spawned rank must not outlive rank 0 (killed by a timeout, say) and keep its GPU memory."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _spawned(rank: int, world: int, port: int, device_type: str, parent: int) -> None:
    _exit_with_parent(parent)
    tp = _join(rank, world, rank, device_type, f"tcp://127.0.0.1:{port}")
    from .worker import serve
    try:
        serve(tp)
    finally:
        import torch.distributed as dist
        dist.destroy_process_group()


def ensure_group(world: int, device_type: str) -> TPGroup:
    """This process's TP group, started on first use. Under torchrun, ranks other than 0
    never return: they serve rank 0's steps, then exit."""
    tp = _state["tp"]
    if tp is not None:
        if tp.world == world:
            return tp
        if torchrun_env() is not None:
            raise ConfigError(f"this process already runs tensor parallel size {tp.world}; asked for {world}")
        shutdown()  # another size (a benchmark sweep): the old ranks exit, new ones start
    if device_type == "cuda" and torch.cuda.device_count() < world and torchrun_env() is None:
        raise ConfigError(f"--tensor-parallel-size {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    set_env()
    tr = torchrun_env()
    if tr is not None:
        rank, w, local = tr
        if w != world:
            raise ConfigError(f"--tensor-parallel-size {world} but torchrun started WORLD_SIZE={w}")
        tp = _join(rank, world, local, device_type, "env://")
        if rank != 0:
            from .worker import serve
            serve(tp)
            sys.exit(0)
    else:
        import torch.multiprocessing as mp
        port = _free_port()
        ctx = mp.get_context("spawn")
        _state["procs"] = [ctx.Process(target=_spawned, args=(r, world, port, device_type, os.getpid()),
                                       daemon=True)
                           for r in range(1, world)]
        for p in _state["procs"]:
            p.start()
        tp = _join(0, world, 0, device_type, f"tcp://127.0.0.1:{port}")
    _state["tp"] = tp
    atexit.register(shutdown)
    return tp


def shutdown() -> None:
    """Rank 0: tell the other ranks to exit, wait for them, leave the group (idempotent)."""
    tp = _state["tp"]
    if tp is None:
        return
    _state["tp"] = None
    import torch.distributed as dist
    from . import control
    try:
        control.send_obj(tp, ("exit",))
    finally:
        # Every rank leaves the group at the same time: a rank's NCCL teardown may wait for its peers, so
        # rank 0 joining the others first could leave them waiting on it (seen on two H200s after graph replays).
        done = _bounded(dist.destroy_process_group, TEARDOWN_S)
        for p in _state["procs"]:
            p.join(timeout=TEARDOWN_S)
            if p.is_alive():
                p.terminate()
        _state["procs"] = []
        if not done:
            print(f"[peregrine] tensor parallel teardown did not finish in {TEARDOWN_S:.0f} s; exiting without it",
                  file=sys.stderr, flush=True)


def _bounded(fn, seconds: float) -> bool:
    """Run fn in a daemon thread; False if it has not returned after `seconds` (it is left behind)."""
    import threading
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()
