"""Prefill pieces: a chunk scheduled beside running decodes runs a few layers per engine step, with a
decode step of the running requests between two pieces. Tokens must be exactly those of the shared
(mixed) step, the decodes must get a token at every piece, and an abort while the chunk is in flight
must not hand its blocks or slot to anybody before its last piece has run."""
from __future__ import annotations

import torch

from peregrine.engine import SamplingParams
from test_prefill import engine

PIECE = 2        # layers per piece: tiny-kimi-linear's 5 layers in 3 pieces
CHUNK = 64       # prompt tokens per step while somebody decodes
G = torch.Generator().manual_seed(31)
A = torch.randint(0, 320, (40,), generator=G).tolist()
B = A + torch.randint(0, 320, (150,), generator=G).tolist()  # shares A's prompt: its 2 full blocks (32 tokens) hit


def run(pieces: int, abort_b_after: int | None = None, prefix_caching: bool = True):
    """A decodes; B arrives after A's 4th token. -> (tokens per request, per step the requests that got
    a token, the engine)."""
    e = engine(prefix_caching, max_num_batched_tokens=256, max_prefill_tokens_while_decoding=CHUNK,
               prefill_piece_layers=pieces)
    toks, steps = {"a": [], "b": []}, []
    e.add_request(A, SamplingParams(max_tokens=30, ignore_eos=True), request_id="a")
    while len(toks["a"]) < 4:
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
    e.add_request(B, SamplingParams(max_tokens=8, ignore_eos=True), request_id="b")
    n = 0
    while e.has_unfinished():
        outs = e.step()
        n += 1
        if abort_b_after is not None and n == abort_b_after:
            assert e._inflight is not None, "B's chunk should be in flight"
            e.abort("b")
        steps.append({o.request_id for o in outs if o.new_token_ids})
        for o in outs:
            toks[o.request_id] += o.new_token_ids
    return toks, steps, e


def test_pieces_give_the_mixed_steps_tokens_and_a_decode_per_piece():
    on, steps_on, e_on = run(PIECE)
    off, steps_off, _ = run(0)
    assert on == off and len(on["a"]) == 30 and len(on["b"]) == 8
    # B's 158 new tokens after its 32 reused: chunks of 64, 64, 30, then B's first token.
    # Shared steps: one per chunk, A's token in each; pieces: 3 per chunk, A's token in each
    before_b = lambda steps: next(i for i, s in enumerate(steps) if "b" in s)  # noqa: E731
    assert all("a" in s for s in steps_on[:before_b(steps_on) + 1])
    assert before_b(steps_off) == 2 and before_b(steps_on) == 3 * 3 - 1
    kinds = e_on.stats["step_kinds"]
    assert kinds["decode + prefill piece"]["steps"] == 9 and kinds["decode + prefill piece"]["prefill_tokens"] == 158
    assert "mixed" not in kinds
    assert e_on.prefix_cache.stats["hit_tokens"] == 32  # B reused A's full prompt blocks (and a KDA snapshot)


def test_pieces_with_prefix_caching_equal_no_caching():
    assert run(PIECE)[0] == run(PIECE, prefix_caching=False)[0]


def test_abort_in_flight_keeps_the_chunks_cache_until_its_last_piece():
    alone, _, _ = run(0, abort_b_after=None)
    e = engine(True, prefill_piece_layers=PIECE)
    free_slots = e.cache.num_free_slots
    toks, steps, e = run(PIECE, abort_b_after=1)
    assert toks["a"] == alone["a"] and toks["b"] == []
    assert e._inflight is None and e.cache.num_free_slots == free_slots
    assert not e.scheduler.running and not e.scheduler.waiting
    # the freed blocks and slot serve a new request exactly
    out = e.generate([B], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out == alone["b"]


def test_abort_in_flight_defers_the_release():
    """While the aborted chunk still has pieces to launch, its sequence keeps its slot and blocks."""
    e = engine(True, max_num_batched_tokens=256, max_prefill_tokens_while_decoding=CHUNK, prefill_piece_layers=PIECE)
    e.add_request(A, SamplingParams(max_tokens=30, ignore_eos=True), request_id="a")
    for _ in range(5):
        e.step()
    e.add_request(B, SamplingParams(max_tokens=8, ignore_eos=True), request_id="b")
    e.step()
    assert e._inflight is not None
    seq = next(s for s, _ in e._inflight.batch)
    slot, blocks = seq.kda_slot, list(seq.blocks)
    e.abort("b")
    assert seq.finished and seq.kda_slot == slot and seq.blocks == blocks  # not given back yet
    assert e.has_unfinished()
    while e._inflight is not None:
        e.step()
    assert seq.kda_slot is None and seq.blocks == []


def test_ttft_bench_counts_the_steps_that_carry_a_chunk():
    """bench ttft's mixed-step figure: one shared step without pieces, one decode step per piece with."""
    from peregrine.bench.ttft import mixed_step_cost
    for pieces, steps in ((0, 1), (PIECE, 3)):
        e = engine(True, max_model_len=1200, max_prefill_tokens_while_decoding=CHUNK, prefill_piece_layers=pieces)
        m = mixed_step_cost(e, 320, reps=1)
        assert m["steps_with_chunk_samples"] == [steps] and m["piece_layers"] == pieces
        assert m["mixed_ms"] <= m["chunk_total_ms"] and not e.has_unfinished()


def test_prompt_logprobs_and_sampling_through_pieces():
    """A request that wants prompt logprobs (every position's logits) and one that samples, both joining
    a running decode: the same logprobs and tokens with and without pieces."""
    def go(pieces):
        e = engine(True, max_prefill_tokens_while_decoding=CHUNK, prefill_piece_layers=pieces)
        got = {}
        e.add_request(A, SamplingParams(max_tokens=20, ignore_eos=True), request_id="a")
        for _ in range(3):
            e.step()
        e.add_request(B[:100], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2), request_id="b",
                      on_token=lambda o: o.prompt_logprobs and got.setdefault("plp", o.prompt_logprobs))
        e.add_request(B[50:90], SamplingParams(max_tokens=6, temperature=0.8, seed=3), request_id="c")
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs, got["plp"], e.stats["step_kinds"]
    (on, plp_on, kinds), (off, plp_off, _) = go(PIECE), go(0)
    assert on == off and len(plp_on) == 100 and "decode + prefill piece" in kinds
    for x, y in zip(plp_on, plp_off):  # the same FP32 forward of B's rows, in pieces or not
        if x is None or y is None:
            assert x is y  # the first prompt token has no logprob
            continue
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-5
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_a_piece_is_launched_before_the_decodes_tokens_are_read(monkeypatch):
    """With the runner's on-device argmax (the specialized path), each piece step launches its piece
    after copying the decode's tokens out and before waiting for them, so the piece's GPU work queues
    behind the decode while the host goes on. Tokens are those of the reference model either way."""
    from fake_runner import PiecedFakeRunner
    from peregrine.engine import lookahead
    from test_engine import make_engine, prompts, ref_generate
    read = lookahead.Readback.tolist
    outs = {}
    for pieces in (0, 2):
        eng, runner, _ = make_engine(greedy=True, runner_cls=PiecedFakeRunner, max_num_batched_tokens=64,
                                     max_prefill_tokens_while_decoding=16, prefill_piece_layers=pieces)
        monkeypatch.setattr(lookahead.Readback, "tolist", lambda self: runner.events.append("read") or read(self))
        a, b = prompts([9, 40], seed=3)
        eng.add_request(a, SamplingParams(max_tokens=20, ignore_eos=True), request_id="a")
        toks = {"a": [], "b": []}
        for _ in range(3):
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
        eng.add_request(b, SamplingParams(max_tokens=6, ignore_eos=True), request_id="b")
        runner.events.clear()
        while eng.has_unfinished():
            for o in eng.step():
                toks[o.request_id] += o.new_token_ids
        outs[pieces] = toks
        if pieces:
            ev = runner.events
            n = ev.count("piece")
            assert n == 3 * 3  # b's 40 prompt tokens: chunks of 16, 16, 8, three advances each
            # every piece precedes the read of its step's decode tokens
            assert all(ev[i + 1] == "read" for i, e in enumerate(ev) if e == "piece"), ev
    assert outs[0] == outs[2]
    assert outs[2]["a"] == ref_generate(a, 20, ignore_eos=True)[0] and outs[2]["b"] == ref_generate(b, 6, ignore_eos=True)[0]


def test_pieces_sized_by_a_time_budget():
    """A piece gets as many layers as fit its time budget at the chunk's measured cost per layer and token (a fake
    clock: every layer of a CHUNK-token chunk costs 4 ms, the budget 9 ms: one layer first, unmeasured, then 2 a
    piece), and the tokens are those of fixed pieces."""
    from peregrine.engine.pieces import PieceSizer
    clock = [0.0]
    e = engine(True, max_num_batched_tokens=256, max_prefill_tokens_while_decoding=CHUNK, prefill_piece_layers=1)
    e.piece_sizer = PieceSizer(9.0, clock=lambda: clock[0])
    sizes, fwd = [], e.runner.forward_pieces

    def pieces(step, n):
        adv = fwd(step, n)

        def advance():
            clock[0] += 4e-3 * step.input_ids.shape[0] / CHUNK
            sizes[-1] += 1
            return adv()
        return advance
    e.runner.forward_pieces = pieces
    real_advance = e._advance_pieces
    e._advance_pieces = lambda: (sizes.append(0), real_advance())[1]
    e.add_request(A, SamplingParams(max_tokens=30, ignore_eos=True), request_id="a")
    toks = {"a": [], "b": []}
    while len(toks["a"]) < 4:
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
    e.add_request(B, SamplingParams(max_tokens=8, ignore_eos=True), request_id="b")
    while e.has_unfinished():
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
    assert toks == run(PIECE)[0]
    # tiny-kimi-linear's 5 layers a chunk; chunks of 64, 64, 30 tokens (B's 158 after its 32 reused)
    assert sizes == [1, 2, 2] + [2, 2, 1] + [4, 1], sizes  # the last chunk (30 tokens): 9 / (4 * 30 / 64) = 4.8 layers
