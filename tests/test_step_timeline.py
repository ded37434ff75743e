"""The graph-replay timeline's arithmetic (peregrine.bench.step_timeline) against a 0.5 µs raster of
the same intervals: increments sum to the span and charge each kernel the end it adds; busy time is
the intervals' union; replays split by count."""
import random

import pytest

from peregrine.bench import step_timeline as st

TICK = 0.5  # µs; every synthetic time is a multiple, so the raster is exact


def _raster_busy(seq):
    ticks = set()
    for k in seq:
        ticks.update(range(int(k["ts"] / TICK), int(k["end"] / TICK)))
    return len(ticks) * TICK


def _raster_increments(seq):
    """Tick by tick: a covered tick goes to the covering kernel that started first, an idle tick to
    the first kernel starting after it."""
    inc = [0.0] * len(seq)
    lo, hi = int(min(k["ts"] for k in seq) / TICK), int(max(k["end"] for k in seq) / TICK)
    for x in range(lo, hi):
        t = x * TICK
        cover = [i for i, k in enumerate(seq) if k["ts"] <= t < k["end"]]
        if cover:
            i = min(cover, key=lambda i: (seq[i]["ts"], seq[i]["end"]))
        else:
            i = min((i for i, k in enumerate(seq) if k["ts"] > t), key=lambda i: seq[i]["ts"])
        inc[i] += TICK
    return inc


def _random_seq(rng, n=40):
    seq, t = [], 0.0
    for i in range(n):
        t += rng.choice([-3, -1, 0, 0.5, 2, 5]) * 1.0  # overlaps (PDL, side stream) and idle gaps
        t = max(t, 0.0)
        d = rng.choice([0.5, 1, 4, 12.5])
        seq.append({"name": f"k{i % 5}", "ts": t, "end": t + d, "stream": 7 + i % 2, "grid": (i % 3, 1, 1)})
        t += d
    return seq


@pytest.mark.parametrize("seed", range(5))
def test_increments_and_busy_time_equal_a_raster_of_the_intervals(seed):
    seq = sorted(_random_seq(random.Random(seed)), key=lambda k: k["ts"])
    inc = st.increments(seq)
    span = max(k["end"] for k in seq) - min(k["ts"] for k in seq)
    assert sum(inc) == pytest.approx(span)
    assert inc == pytest.approx(_raster_increments(seq))
    assert st.busy_us(seq) == pytest.approx(_raster_busy(seq))


def test_a_kernel_hidden_under_a_longer_one_costs_nothing_and_an_idle_gap_is_charged_to_the_next():
    seq = [{"name": "long", "ts": 0.0, "end": 10.0, "stream": 1, "grid": ()},
           {"name": "side", "ts": 2.0, "end": 5.0, "stream": 2, "grid": ()},
           {"name": "after_gap", "ts": 13.0, "end": 14.0, "stream": 1, "grid": ()}]
    assert st.increments(seq) == [10.0, 0.0, 4.0]
    assert st.busy_us(seq) == 11.0
    s = st.summarize([seq])
    assert s["span_us"] == 14.0 and s["early_starts"] == 1
    assert [g["kernel"] for g in s["groups"]] == ["long", "after_gap", "side"]


def test_chrome_trace_kernels_split_into_replays():
    evs = [{"cat": "kernel", "name": f"k{i % 3}", "ts": i * 10, "dur": 4, "args": {"stream": 7, "grid": [i % 3, 1, 1]}}
           for i in range(6)]
    evs.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 1})
    ks = st.kernel_events({"traceEvents": evs})
    assert [k["name"] for k in ks] == ["k0", "k1", "k2"] * 2
    a, b = st.split_replays(ks, 2)
    assert [k["ts"] for k in b] == [30.0, 40.0, 50.0] and a[0]["grid"] == (0, 1, 1)
    with pytest.raises(ValueError, match="do not split"):
        st.split_replays(ks, 4)


@pytest.mark.parametrize("vocab", [163840, 300, 7920])
def test_distinct_tokens_give_every_row_its_own_in_range_token(vocab):
    """--distinct-tokens: B rows, B different ids, none the capture's token 0, all inside the vocabulary
    (7920: a vocabulary whose size - 1 the stride divides, where the stride alone would repeat)."""
    for B in (1, 2, 8, 16):
        ids = st.distinct_tokens(B, vocab)
        assert len(ids) == B and len(set(ids)) == B and all(0 < t < vocab for t in ids), (B, vocab, ids)
