"""The persistent layer's task list (peregrine/persistent): run by the emulator in the static schedule's order and
in random orders its dependencies allow, over NaN-poisoned scratch, it equals the chain (the layer through each
kernel's FP32 reference) in FP32, outputs and KDA states; a dependency left out of the declarations is caught."""
import random

import pytest
import torch

from peregrine.persistent import emulator, tasks

D, H, d, R, E, I, K, IS, W = 96, 3, 16, 16, 10, 48, 3, 32, 4  # odd sizes: partial tiles everywhere


def weights(seed=0, bounded=False) -> tasks.LayerWeights:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, sc=0.2: torch.randn(*s, generator=g) * sc  # noqa: E731
    Hd = H * d
    return tasks.LayerWeights(
        in_norm=1 + rnd(D), in_proj=rnd(3 * Hd + 2 * R + H, D), f_b=rnd(Hd, R), g_b=rnd(Hd, R), conv_w=rnd(3 * Hd, W, sc=0.5),
        A_log=rnd(H, sc=0.5), dt_bias=rnd(Hd), o_norm=1 + rnd(d), o_proj=rnd(D, Hd), post_norm=1 + rnd(D),
        gate_w=rnd(E, D), bias=rnd(E, sc=0.01), w13=rnd(E, 2 * I, D), w2=rnd(E, D, I), shared13=rnd(2 * IS, D),
        shared2=rnd(D, IS), H=H, d=d, top_k=K, lower_bound=-5.0 if bounded else None)


def inputs(B, seed=1):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(B + 2, generator=g)[:B]
    return (torch.randn(B, D, generator=g), torch.randn(B + 2, H, d, d, generator=g) * 0.1,
            torch.randn(B + 2, W - 1, 3 * H * d, generator=g), slots)


def emulate(w, B, order_fn, tile=32, drop=None):
    resid, state, conv, slots = inputs(B)
    ts = tasks.build(w, B, tile)
    if drop is not None:
        drop(ts)
    s = tasks.scratch(w, B)
    s.update(resid=resid, state=state.clone(), conv_state=conv.clone(), slots=slots)
    emulator.run(ts, order_fn(ts), s)
    st, cv = state.clone(), conv.clone()
    want = tasks.chain(w, resid, st, cv, slots)
    return s, want, st, cv


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,bounded", [(1, False), (3, True), (8, False)])
def test_schedule_order_equals_chain(B, bounded):
    w = weights(B, bounded)

    def order(ts):
        lists, start = emulator.schedule(ts, num_sms=7)
        emulator.check_schedule(ts, lists)
        return emulator.schedule_order(ts, lists, start)
    s, want, st, cv = emulate(w, B, order)
    assert torch.isfinite(s["out"]).all()
    assert close(s["out"], want) and close(s["state"], st) and close(s["conv_state"], cv)


@pytest.mark.parametrize("seed", range(6))
def test_random_orders_equal_chain(seed):
    w, B = weights(10 + seed), 1 + seed % 4
    rng = random.Random(seed)
    s, want, st, cv = emulate(w, B, lambda ts: emulator.random_order(ts, rng))
    assert close(s["out"], want) and close(s["state"], st) and close(s["conv_state"], cv)


def test_a_missing_dependency_is_caught():
    """o_proj's first tile declares it reads all of o; take away its wait on the last head's recurrence and run
    it first among what the graph then allows: it reads the NaN poison and the output shows it."""
    w, B = weights(3), 2

    def drop(ts):
        last = next(i for i, t in enumerate(ts) if t.name == f"kda[{H - 1}]")
        t = next(t for t in ts if t.name == "o_proj[0]")
        t.deps = [p for p in t.deps if p != last]

    def eager(ts):  # among ready tasks always take o_proj[0] first (a valid order for the weakened graph)
        order = emulator.random_order(ts, random.Random(0))
        i = next(n for n, t in enumerate(ts) if t.name == "o_proj[0]")
        order.remove(i)
        need = set(ts[i].deps)
        at = max(order.index(p) for p in need) + 1
        return order[:at] + [i] + order[at:]
    s, want, _, _ = emulate(w, B, eager, drop=drop)
    assert not torch.isfinite(s["out"][:, :32]).all()


def test_deps_are_the_regions_overlaps():
    """Spot checks of the derived graph: a head's recurrence waits for the in-projection tiles holding its q, k, v,
    its gate columns and its beta, and for its gates task; combine waits for every assignment's down tile."""
    w, B = weights(4), 2
    ts = tasks.build(w, B, tile=32)
    names = {t.name: i for i, t in enumerate(ts)}
    kda1 = {ts[p].name for p in ts[names["kda[1]"]].deps}
    Hd, P = H * d, 3 * H * d + 2 * R + H
    cols = [(d + j * Hd, 2 * d + j * Hd) for j in range(3)] + [(3 * Hd + 2 * R + 1, 3 * Hd + 2 * R + 2)]  # q k v, beta
    want_tiles = {f"in_proj[{lo}]" for lo in range(0, P, 32) for a, b in cols if lo < b and a < lo + 32}
    assert kda1 == want_tiles | {"gates[1]"}, kda1
    comb = {ts[p].name for p in ts[names["combine[0]"]].deps}
    assert {f"down[{j},0]" for j in range(B * K)} <= comb and "norm_post" in comb and "router" in comb


@pytest.mark.parametrize("B,sms", [(1, 132), (4, 16)])
def test_schedule_at_48b_widths_is_valid_and_near_its_bounds(B, sms):
    """The 48B layer's task list (meta tensors: shapes only) scheduled over the SMs: every task placed once, no SM
    waits on a task queued behind it, and the makespan sits between its two lower bounds (the critical path, the
    bytes spread evenly) and list scheduling's guarantee (their sum)."""
    w = emulator.meta_weights(2304, 32, 128, 256, 1024, 8, 1024)
    r = emulator.report(w, B, sms, tile=64)
    lower = max(r["critical_path"], r["even_spread"])
    assert lower <= r["makespan"] <= r["critical_path"] + r["even_spread"], r
    assert r["weight_bytes"] > 0 and r["tasks"] > 100
