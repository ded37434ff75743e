"""A static schedule of persistent/tasks.py's task list over the GPU's SMs, and a CPU emulator that runs the list.

The schedule is what the persistent kernel would be launched with: per SM, a fixed list of tasks (no queue, no
atomics to claim work), each task waiting on one dependency counter per producer set (`deps`). It is list
scheduling by weight bytes: tasks in dependency order, longest remaining path first, each placed on the SM that can
start it earliest (its own list's end, or its last dependency's end). The emulator runs any order the dependencies
allow (the schedule's, by simulated start time, or a random one) over NaN-poisoned scratch, so a dependency missing
from the declarations shows up as NaN or a wrong number against tasks.chain.
"""
from __future__ import annotations

import random

import torch

from .tasks import LayerWeights, Task, build

TASK_OVERHEAD_BYTES = 2048  # a task's fixed cost in byte-equivalents (dependency wait, prologue): ~0.5 us of an SM


def critical_path(tasks: list[Task]) -> list[float]:
    """Bytes on the longest path from each task to the end."""
    users: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        for p in t.deps:
            users[p].append(i)
    rest = [0.0] * len(tasks)
    for i in reversed(range(len(tasks))):
        rest[i] = tasks[i].nbytes + TASK_OVERHEAD_BYTES + max((rest[u] for u in users[i]), default=0.0)
    return rest


def schedule(tasks: list[Task], num_sms: int) -> tuple[list[list[int]], list[float]]:
    """(per SM its task list, each task's simulated start in byte-equivalents)."""
    rest = critical_path(tasks)
    done = [None] * len(tasks)
    start = [0.0] * len(tasks)
    free = [0.0] * num_sms
    lists: list[list[int]] = [[] for _ in range(num_sms)]
    waiting = {i: len(t.deps) for i, t in enumerate(tasks)}
    users: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        for p in t.deps:
            users[p].append(i)
    ready = [i for i, n in waiting.items() if n == 0]
    while ready:
        ready.sort(key=lambda i: (-rest[i], i))
        i = ready.pop(0)
        t0 = max((done[p] for p in tasks[i].deps), default=0.0)
        sm = min(range(num_sms), key=lambda s: (max(free[s], t0), s))
        start[i] = max(free[sm], t0)
        done[i] = free[sm] = start[i] + tasks[i].nbytes + TASK_OVERHEAD_BYTES
        lists[sm].append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    assert all(d is not None for d in done), "the task graph has a cycle"
    return lists, start


def check_schedule(tasks: list[Task], lists: list[list[int]]) -> None:
    """Every task on exactly one SM; along each SM's list, a task's dependencies are on earlier positions of some
    list whose own waits do not wait on it (no SM waits for a task queued behind it on the same SM)."""
    seen = sorted(i for lst in lists for i in lst)
    assert seen == list(range(len(tasks))), "a task is missing or placed twice"
    pos = {i: (s, n) for s, lst in enumerate(lists) for n, i in enumerate(lst)}
    for i, t in enumerate(tasks):
        for p in t.deps:
            if pos[p][0] == pos[i][0]:
                assert pos[p][1] < pos[i][1], f"{t.name} waits for {tasks[p].name} queued after it on SM {pos[i][0]}"


def schedule_order(tasks: list[Task], lists: list[list[int]], start: list[float]) -> list[int]:
    """The global order the schedule runs in: by simulated start, SM lists interleaved."""
    return sorted(range(len(tasks)), key=lambda i: (start[i], i))


def random_order(tasks: list[Task], rng: random.Random) -> list[int]:
    """A uniformly drawn ready task at each step: any order the dependencies allow can come out."""
    waiting = {i: len(t.deps) for i, t in enumerate(tasks)}
    users: list[list[int]] = [[] for _ in tasks]
    for i, t in enumerate(tasks):
        for p in t.deps:
            users[p].append(i)
    ready, order = [i for i, n in waiting.items() if n == 0], []
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    assert len(order) == len(tasks), "the task graph has a cycle"
    return order


def run(tasks: list[Task], order: list[int], state: dict) -> dict:
    """Run the tasks in `order` over `state` (scratch and inputs), checking each only starts after its deps."""
    done = set()
    for i in order:
        missing = [tasks[p].name for p in tasks[i].deps if p not in done]
        assert not missing, f"{tasks[i].name} ran before {missing}"
        tasks[i].fn(state)
        done.add(i)
    return state


def meta_weights(D: int, H: int, d: int, E: int, I: int, k: int, shared_I: int, W: int = 4):
    """LayerWeights of a model's widths on the meta device: shapes and byte counts, no memory (the schedule's)."""
    m = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    Hd = H * d
    return LayerWeights(in_norm=m(D), in_proj=m(3 * Hd + 2 * d + H, D), f_b=m(Hd, d), g_b=m(Hd, d), conv_w=m(3 * Hd, W),
                        A_log=m(H), dt_bias=m(Hd), o_norm=m(d), o_proj=m(D, Hd), post_norm=m(D), gate_w=m(E, D), bias=m(E),
                        w13=m(E, 2 * I, D), w2=m(E, D, I), shared13=m(2 * shared_I, D), shared2=m(D, shared_I), H=H, d=d, top_k=k)


def report(w, B: int, num_sms: int, tile: int) -> dict:
    """The static schedule of one layer under its own cost model (byte-equivalents, TASK_OVERHEAD_BYTES a task):
    how long its critical path is against the bytes spread evenly over the SMs. A design figure, not a timing."""
    ts = build(w, B, tile)
    lists, start = schedule(ts, num_sms)
    check_schedule(ts, lists)
    total = sum(t.nbytes + TASK_OVERHEAD_BYTES for t in ts)
    makespan = max(start[i] + ts[i].nbytes + TASK_OVERHEAD_BYTES for i in range(len(ts)))
    return {"B": B, "tasks": len(ts), "weight_bytes": sum(t.nbytes for t in ts),
            "deps": sum(len(t.deps) for t in ts), "critical_path": critical_path(ts)[0] if ts else 0.0,
            "even_spread": total / num_sms, "makespan": makespan, "makespan_over_even": makespan / (total / num_sms)}


def main() -> None:
    import argparse
    import json
    from ..config import resolve_model
    ap = argparse.ArgumentParser(description="The static schedule of one KDA + MoE decoder layer's task list "
                                 "(persistent decode, issue #46): task count, dependencies, and how its critical path "
                                 "compares with the layer's bytes spread evenly over the SMs, under the schedule's cost "
                                 "model (not a timing)")
    ap.add_argument("--model", default="kimi-linear-48b-a3b", help="preset or model folder (its widths)")
    ap.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated B")
    ap.add_argument("--sms", type=int, default=132, help="SMs (H100 / H200: 132)")
    ap.add_argument("--tile", type=int, default=64, help="output columns a task")
    a = ap.parse_args()
    c, _ = resolve_model(a.model)
    w = meta_weights(c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.num_experts, c.moe_intermediate_size,
                     c.num_experts_per_token, c.moe_intermediate_size * max(1, c.num_shared_experts))
    for B in (int(x) for x in a.batch_sizes.split(",")):
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in report(w, B, a.sms, a.tile).items()}),
              flush=True)


if __name__ == "__main__":
    main()
