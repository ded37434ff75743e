"""The persistent MoE decode block (issue #20 prototype) under the interpreter: one launch whose
programs pull tasks from a queue. Against the FP32 reference in its table order; in random orders
that respect only the declared dependencies, with NaN-poisoned scratch (bitwise the same output:
every task's arithmetic is fixed, only the order changes); over repeated launches (the epochs:
nothing is zeroed between them); and a table that puts a task before what it waits on trips the
error word instead of hanging."""
from __future__ import annotations

import pytest
import torch

from peregrine import kernels
from peregrine.kernels import persistent_moe as P
from peregrine.testing import rel_rmse

pytestmark = pytest.mark.skipif(not kernels.available("cpu") and not torch.cuda.is_available(),
                                reason="triton kernels unavailable")
DEV = "cuda" if torch.cuda.is_available() and not kernels.interpreting() else "cpu"
# odd widths: D and I not multiples of the tiles, E not a power of two
CASES = [P.Shapes(B=1, D=72, E=12, I=40, IS=24, top_k=3), P.Shapes(B=3, D=40, E=16, I=20, IS=0, top_k=4),
         P.Shapes(B=2, D=300, E=8, I=72, IS=16, top_k=2)]  # two combine tiles, three up tiles per assignment


def weights(s: P.Shapes, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).to(dtype).to(DEV)  # noqa: E731
    return dict(x=r(s.B, s.D), gate_w=r(s.E, s.D, std=s.D ** -0.5), bias=r(s.E, std=0.1).float(),
                w13=r(s.E, 2 * s.I, s.D, std=s.D ** -0.5), w2=r(s.E, s.D, s.I, std=s.I ** -0.5),
                shared_w13=r(2 * s.IS, s.D, std=s.D ** -0.5) if s.IS else None,
                shared_w2=r(s.D, s.IS, std=s.IS ** -0.5) if s.IS else None)


def run(s, w, ws, **kw):
    out = torch.full((s.B, s.D), float("nan"), dtype=w["x"].dtype, device=DEV)
    return P.moe_block(w["x"], w["gate_w"], w["bias"], w["w13"], w["w2"], w["shared_w13"], w["shared_w2"], ws,
                       renormalize=kw.pop("renormalize", True), scaling=kw.pop("scaling", 2.5), out=out, **kw)


@pytest.mark.parametrize("s", CASES, ids=lambda s: f"B{s.B}-D{s.D}-E{s.E}-I{s.I}-S{s.IS}-k{s.top_k}")
def test_table_order_equals_reference_and_random_orders_are_bitwise_equal(s):
    w = weights(s, 1)
    ref, ids = P.moe_block_ref(w["x"], w["gate_w"], w["bias"], w["w13"], w["w2"], w["shared_w13"], w["shared_w2"],
                               s.top_k, True, 2.5)
    ws = P.Workspace(s, DEV)
    ws.poison()
    first = run(s, w, ws)
    assert ws.err.item() == 0 and not first.isnan().any()
    assert rel_rmse(first, ref) < 1e-5
    assert torch.equal(ws.ids.long().sort(-1).values, ids.sort(-1).values)
    table, _ = P.task_table(s)
    for seed in range(3):
        order = P.random_order(table, s, seed)
        assert order != table
        wr = P.Workspace(s, DEV, tasks=order)
        wr.poison()
        assert torch.equal(run(s, w, wr), first), f"order seed {seed}"
        assert wr.err.item() == 0


def test_repeated_launches_reuse_counters_without_zeroing():
    """Epochs: three launches on one workspace (new inputs each time) each equal the reference; the
    counters and the queue only grew, by the table's counts and N + P tickets per launch."""
    s = CASES[0]
    ws = P.Workspace(s, DEV)
    n = ws.tasks.shape[0]
    for i in range(3):
        w = weights(s, 10 + i)
        ref, _ = P.moe_block_ref(w["x"], w["gate_w"], w["bias"], w["w13"], w["w2"], w["shared_w13"], w["shared_w2"],
                                 s.top_k, True, 2.5)
        ws.poison()
        assert rel_rmse(run(s, w, ws), ref) < 1e-5, f"launch {i + 1}"
    assert ws.epoch.item() == 4 and ws.queue.item() == 3 * (n + ws.programs)
    assert ws.counters.tolist() == P.expected_counts(s, launches=3)
    # per token, per assignment, per combine tile: as narrow as the data
    assert len(ws.counters) == 2 + s.B + s.B * s.top_k + -(-s.D // P.BLOCK_M)
    assert ws.err.item() == 0


def test_a_task_before_its_dependency_trips_the_error_word():
    """COMBINE first: its wait cannot be met (the interpreter runs it before any DOWN task), so it gives
    up after max_spins polls and flags its task number; the launch still ends."""
    s = CASES[1]
    table, _ = P.task_table(s)
    comb = [t for t in table if t[0] == P.COMBINE]
    bad = comb + [t for t in table if t[0] != P.COMBINE]
    ws = P.Workspace(s, DEV, tasks=bad, programs=1)
    run(s, weights(s, 2), ws, max_spins=8)
    assert ws.err.item() >= 1  # task number + 1 of a combine task that waited in vain
    assert ws.err.item() <= len(comb)


def test_random_orders_respect_the_declared_dependencies():
    """Orders that only the kernel's narrow dependencies allow: a token's experts before another token's
    top-k, an assignment's down tiles before another's up tiles, a combine tile before unrelated down tiles."""
    s = CASES[2]
    table, _ = P.task_table(s)
    seen_early = set()
    for seed in range(5):
        order = P.random_order(table, s, seed)
        assert sorted(order) == sorted(table)
        pos = {t: i for i, t in enumerate(order)}
        for t in order:
            assert all(pos[u] < pos[t] for u in table if P.waits_on(t, u, s))
        kinds = [t[0] for t in order]
        first_down = kinds.index(P.DOWN)
        if P.UP in kinds[first_down:]:
            seen_early.add("down before the last up")
        first_comb = kinds.index(P.COMBINE)
        if P.DOWN in kinds[first_comb:]:
            seen_early.add("combine before the last down")
    assert seen_early == {"down before the last up", "combine before the last down"}


def test_compiles_for_sm90_at_kimi_linear_widths():
    """Ahead of time for sm_90a (no GPU needed): the whole task loop compiles; its resources are recorded."""
    from conftest import run_aot
    r = run_aot("import json; from peregrine.bench import persistent_moe as b; print(json.dumps(b.compile_check()))")
    assert "error" not in r and r["regs"] > 0, r
