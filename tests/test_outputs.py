"""What the engine hands back besides token ids: text with stop strings (streamed, held back while a
stop string may still complete, cut at the first one however it splits over tokens), logprobs of
sampled and of prompt tokens, min_tokens, presence/frequency penalties.

Expectations come from outside the engine: a scripted runner whose tokens the test chooses (stop
strings are then plain string operations on the script), the hash-based FakeRunner's ref_logits,
explicit penalty loops, and the independent FP64 reference forward of the tiny model.
"""
from __future__ import annotations

import pytest
import torch

from fake_runner import FakeRunner, device_tokens, ref_logits
from kimi_files import ranks, vocab_size, write_tokenizer
from peregrine.cache import ModelCache
from peregrine.config import EngineConfig, resolve_model
from peregrine.engine import RequestError, SamplingParams
from peregrine.engine.engine import LLMEngine
from peregrine.tokenizer import ByteTokenizer

CFG, _ = resolve_model("tiny-kimi-linear")
V = CFG.vocab_size
EOS = CFG.eos_token_id
BIG = 50.0  # logit margin of the scripted token: greedy takes it, and so does any sampling


class ScriptRunner:
    """Next-token logits from a function of (position in the output, context length): fn(j) -> [V].
    Every sequence of a step must share one prompt length P (the test's)."""

    def __init__(self, fn, P: int, greedy: bool = False, device: bool = False):
        """greedy: decode steps also return their argmax (lookahead); device: and honour the step's sampling,
        penalties and logprobs as the specialized runner does (fake_runner.device_tokens)."""
        self.fn, self.P = fn, P
        self.lookahead, self.greedy_tokens = greedy or device, None
        self.device_sampler, self.device_logprobs = device, None
        self.sampled_steps = self.penalty_steps = self.logprob_steps = 0
        self.last_path, self.fallback_reasons = "standard", {}

    def forward(self, step):
        rows = [self.fn(n - self.P) for n in step.context_lens]
        out = torch.stack(rows)
        self.greedy_tokens = None
        if self.lookahead and step.is_decode:
            self.greedy_tokens = device_tokens(self, step, out) if self.device_sampler else out.argmax(-1)
        self.last_path = "latency_specialized" if step.is_decode else "standard"
        return out


def script(tokens: list[int]):
    """Logits choosing tokens[j] at output position j (then EOS), over a seeded random background."""
    def fn(j):
        g = torch.Generator().manual_seed(1000 + j)
        x = torch.randn(V, generator=g)
        x[tokens[j] if j < len(tokens) else EOS] += BIG
        return x
    return fn


def engine(runner, tokenizer=None, **ecfg):
    cache = ModelCache(CFG, num_blocks=64, block_size=4, num_slots=4, dtype=torch.float32, device="cpu")
    return LLMEngine(runner, CFG, EngineConfig(block_size=4, max_model_len=128, **ecfg), cache,
                     tokenizer=ByteTokenizer(V) if tokenizer is None else tokenizer)


def run(eng, prompt, params):
    """-> (every output in order, the final one)."""
    outs = []
    eng.add_request(prompt, params, on_token=outs.append)
    while eng.has_unfinished():
        eng.step()
    assert outs[-1].finished
    return outs, outs[-1]


PROMPT = [1, 2, 3]


# ---------------------------------------------------------------- stop strings
@pytest.mark.parametrize("greedy", [False, True])  # True: decode lookahead, stops checked one step late
@pytest.mark.parametrize("text,stop,want", [
    ("The answer is 42.\nNext line", ["\nN"], "The answer is 42."),     # two tokens: "\n" then "N"
    ("a\nb\nNc", ["\nN"], "a\nb"),                                     # a false start is released
    ("naïve ünï", ["ïv"], "na"),                                      # 'ï' is two byte tokens
    ("abcdef", ["abcd", "bc"], "a"),                                  # the first to complete wins
    ("xyz", ["q"], "xyz"),                                            # never found: length
])
def test_stop_strings_across_tokens(greedy, text, stop, want):
    toks = list(text.encode())
    eng = engine(ScriptRunner(script(toks), len(PROMPT), greedy))
    outs, last = run(eng, PROMPT, SamplingParams(max_tokens=len(toks), stop=stop))
    streamed = "".join(o.text_delta for o in outs)
    assert streamed == last.text == want
    if want == text:
        assert (last.finish_reason, last.stop_str, last.output_token_ids) == ("length", None, toks)
        return
    # it stops at the token that completes the first stop string, whichever it is
    end = min(text.find(s) + len(s) for s in stop if s in text)
    n_tok = len(text[:end].encode())
    assert last.finish_reason == "stop" and last.output_token_ids == toks[:n_tok]
    assert last.stop_str in stop and text[:end].endswith(last.stop_str)
    # nothing that could begin a stop string was streamed before it was known not to be one
    sent = ""
    for o in outs:
        sent += o.text_delta
        assert want.startswith(sent)


def test_held_back_text_and_split_characters():
    text = "ok\nnaïve"
    toks = list(text.encode())
    outs, last = run(engine(ScriptRunner(script(toks), 3)), PROMPT, SamplingParams(max_tokens=len(toks), stop=["\nX"]))
    deltas = [o.text_delta for o in outs]
    assert deltas[2] == ""       # "\n" may begin "\nX": held back
    assert deltas[3] == "\nn"    # "n" shows it does not: both released
    assert deltas[5] == "" and deltas[6] == "ï"  # the first byte of 'ï' is no text yet
    assert "".join(deltas) == last.text == text and last.finish_reason == "length"


def test_stop_strings_wait_for_min_tokens_and_exclude_eos():
    toks = list(b"xx.yy.zz")
    _, last = run(engine(ScriptRunner(script(toks), 3)), PROMPT, SamplingParams(max_tokens=8, stop=["."], min_tokens=4))
    assert last.text == "xx.yy" and last.output_token_ids == toks[:6]  # the '.' at token 3 is too early
    _, last = run(engine(ScriptRunner(script(list(b"hi")), 3)), PROMPT, SamplingParams(max_tokens=8))
    assert last.output_token_ids == [104, 105, EOS] and last.text == "hi" and last.finish_reason == "stop"


def test_stop_strings_with_multi_byte_tokens(tmp_path):
    """Kimi's tokenizer: a stop string may end inside a token ('ll' in 'hello') or span several."""
    write_tokenizer(tmp_path)
    from peregrine.kimi_tokenizer import KimiTokenizer
    tok = KimiTokenizer(tmp_path, vocab_size())
    r = ranks()
    toks = [r[b"hello"], r[b" world"], r[b"hello"], r[b" world"]]
    cfg = CFG.__class__(**{**CFG.to_dict(), "vocab_size": vocab_size()})

    def fn(j):
        x = torch.zeros(vocab_size())
        x[toks[j] if j < len(toks) else cfg.eos_token_id] = BIG
        return x
    for stop, want, n in ((["ll"], "he", 1), (["dhe"], "hello worl", 3), (["o w"], "hell", 2)):
        cache = ModelCache(cfg, num_blocks=16, block_size=4, num_slots=2, dtype=torch.float32, device="cpu")
        eng = LLMEngine(ScriptRunner(fn, 3), cfg, EngineConfig(block_size=4, max_model_len=64), cache, tokenizer=tok)
        outs, last = run(eng, PROMPT, SamplingParams(max_tokens=4, stop=stop))
        assert last.text == want == "".join(o.text_delta for o in outs) and last.output_token_ids == toks[:n]


def test_stop_strings_need_a_tokenizer():
    cache = ModelCache(CFG, num_blocks=8, block_size=4, num_slots=1, dtype=torch.float32, device="cpu")
    eng = LLMEngine(FakeRunner(cache, V), CFG, EngineConfig(block_size=4, max_model_len=32), cache)
    with pytest.raises(RequestError, match="tokenizer"):
        eng.add_request(PROMPT, SamplingParams(stop=["x"]))
    with pytest.raises(RequestError, match="stop"):
        eng.add_request(PROMPT, SamplingParams(stop=[""]))


# ---------------------------------------------------------------- logprobs
def fake_engine(greedy=False):
    cache = ModelCache(CFG, num_blocks=64, block_size=4, num_slots=4, dtype=torch.float32, device="cpu")
    return LLMEngine(FakeRunner(cache, V, greedy=greedy), CFG, EngineConfig(block_size=4, max_model_len=128), cache,
                     tokenizer=ByteTokenizer(V))


@pytest.mark.parametrize("temperature,greedy_runner", [(0.0, False), (0.0, True), (0.7, False), (0.7, True)])
def test_logprobs_of_sampled_tokens(temperature, greedy_runner):
    prompt = [5, 9, 11, 2]
    eng = fake_engine(greedy_runner)
    outs, last = run(eng, prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=3,
                                                 logprobs=3))
    toks = last.output_token_ids
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == len(toks) == 12
    for j, (t, lp) in enumerate(zip(toks, lps)):
        ref = torch.log_softmax(ref_logits(prompt + toks[:j], V).double(), -1)  # raw: before temperature
        assert lp.token_id == t and lp.logprob == pytest.approx(ref[t].item(), abs=1e-5)
        v, i = ref.topk(3)
        assert [a for a, _ in lp.top] == i.tolist() and [b for _, b in lp.top] == pytest.approx(v.tolist(), abs=1e-5)
    if temperature == 0:
        assert all(lp.top[0][0] == lp.token_id for lp in lps)  # greedy: the chosen token is the most likely
    # a runner with on-device tokens takes the logprobs in its step too (#41), so those steps run ahead
    assert (eng.stats["lookahead_steps"] > 0) == greedy_runner


def test_prompt_logprobs_against_the_reference_model():
    """Chunked prefill next to another request; every prompt token's logprob and top-2 against the
    independent FP64 forward (tests/reference.py)."""
    from peregrine.engine.build import build_engine
    from reference import reference_forward
    eng, tok = build_engine("tiny-kimi-linear", EngineConfig(dtype="fp32", max_model_len=64, max_num_batched_tokens=4,
                                                             block_size=4), dummy_weights=True, log=lambda m: None)
    W = {n: v.reshape(s).clone() for n, v, s in eng.model.hf_params()}
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 256, (9,), generator=g).tolist()
    other = []
    eng.add_request(torch.randint(0, 256, (6,), generator=g).tolist(), SamplingParams(max_tokens=3, ignore_eos=True),
                    on_token=other.append)
    outs, last = run(eng, prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=1))
    assert other[-1].finished
    plp = outs[0].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None and all(o.prompt_logprobs is None for o in outs[1:])
    seq = prompt + last.output_token_ids
    ref = torch.log_softmax(reference_forward(W, eng.model_cfg, seq), -1)
    for p in range(1, len(prompt)):
        e = plp[p]
        assert e.token_id == prompt[p] and e.logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
        assert [a for a, _ in e.top] == ref[p - 1].topk(2).indices.tolist()
    gen = [lp for o in outs for lp in o.logprobs]
    for j, lp in enumerate(gen):
        assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + j, seq[len(prompt) + j]].item(), abs=1e-4)


# ---------------------------------------------------------------- penalties, min_tokens
def favourite(j):
    """Token 65 leads 66 by 1.5 and 67 by 5 at every position: penalties move greedy off it."""
    x = torch.randn(V, generator=torch.Generator().manual_seed(j)) * 0.1
    x[65], x[66], x[67] = 10.0, 8.5, 5.0
    return x


def reference_penalised(fn, n, presence, frequency):
    out = []
    for j in range(n):
        x = fn(j).clone()
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("presence,frequency", [(0.0, 1.0), (2.0, 0.0), (0.5, 0.75), (-1.0, 0.0)])
def test_presence_and_frequency_penalties(presence, frequency, device):
    """host: the engine applies them to the logits; device: the runner does, from counts the engine keeps on
    the device (engine/penalties.DevicePenalties), with decode lookahead."""
    want = reference_penalised(favourite, 10, presence, frequency)
    runner = ScriptRunner(favourite, 3, greedy=True, device=device)
    eng = engine(runner)
    _, last = run(eng, PROMPT,
                  SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency))
    assert last.output_token_ids == want
    assert (runner.penalty_steps >= 8 and eng.stats["lookahead_steps"] >= 7) if device else runner.penalty_steps == 0
    if presence > 0 or frequency > 0:
        assert len(set(want)) > 1  # the penalty did change the choice


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("r", [1.3, 2.0, 0.8])
def test_repetition_penalty(r, device):
    """Every token of the prompt or the output so far: a positive logit divided by r, another multiplied."""
    def reference(n):
        out = []
        for j in range(n):
            x = favourite(j).clone()
            for t in set(PROMPT) | set(out):
                x[t] = x[t] / r if x[t] > 0 else x[t] * r
            out.append(int(x.argmax()))
        return out
    want = reference(10)
    runner = ScriptRunner(favourite, 3, greedy=True, device=device)
    _, last = run(engine(runner), PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=r))
    assert last.output_token_ids == want
    assert (runner.penalty_steps >= 8) == device
    if r > 1:
        assert len(set(want)) > 1  # the penalty did change the choice


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_min_tokens_holds_off_end_and_stop_ids(device):
    """host: the engine masks the logits; device: the runner does (the ban ids and the prompt length + min_tokens
    in StepInput.penalties), with decode lookahead."""
    def eos_early(j):  # EOS is the favourite from the first token on; token 70 would be the stop id
        x = torch.randn(V, generator=torch.Generator().manual_seed(j))
        x[EOS], x[70] = 20.0, 15.0
        return x
    runner = ScriptRunner(eos_early, 3, device=device)
    _, last = run(engine(runner), PROMPT, SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[70]))
    assert (runner.penalty_steps >= 3) == device
    # EOS and 70 are masked for the first 4 tokens; the 5th may end it
    want = [int(torch.cat([eos_early(j)[:70], torch.tensor([-1e9]), eos_early(j)[71:EOS], torch.tensor([-1e9]),
                           eos_early(j)[EOS + 1:]]).argmax()) for j in range(4)] + [EOS]
    assert last.output_token_ids == want and last.finish_reason == "stop"
    with pytest.raises(RequestError, match="min_tokens"):
        engine(ScriptRunner(eos_early, 3)).add_request(PROMPT, SamplingParams(max_tokens=3, min_tokens=4))


def test_every_end_id_stops():
    """generation_config.json's end ids (ModelConfig.extra_eos_token_ids) end a generation like eos_token_id."""
    import dataclasses
    cfg = dataclasses.replace(CFG, extra_eos_token_ids=(300,))
    cache = ModelCache(cfg, num_blocks=16, block_size=4, num_slots=2, dtype=torch.float32, device="cpu")
    eng = LLMEngine(ScriptRunner(script([104, 300, 105]), 3), cfg, EngineConfig(block_size=4, max_model_len=64), cache,
                    tokenizer=ByteTokenizer(V))
    _, last = run(eng, PROMPT, SamplingParams(max_tokens=5))
    assert (last.output_token_ids, last.finish_reason, last.text) == ([104, 300], "stop", "h")
    _, last = run(eng, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert last.output_token_ids == [104, 300, 105] and last.text == "h<300>i"


def test_text_of_a_tokenizer_json_model(tmp_path):
    """tokenizer.json: a token's text can depend on its neighbour (SentencePiece drops the leading space
    of a text's first token), so the stream decodes windows, never one token alone."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from peregrine.tokenizer import HFTokenizer
    words = ["▁hello", "▁world", "▁peregrine", "[unk]"]
    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[unk]"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    toks = [0, 1, 2, 1]
    assert tok.decode(toks) == "hello world peregrine world" and tok.decode([1]) == "world"
    for stop, want, n in (([], "hello world peregrine world", 4), (["d pe"], "hello worl", 3)):
        outs, last = run(engine(ScriptRunner(script(toks), 3), tokenizer=tok), PROMPT,
                         SamplingParams(max_tokens=4, stop=stop))
        assert "".join(o.text_delta for o in outs) == last.text == want and len(last.output_token_ids) == n


def test_device_penalties_equal_process_row_by_row():
    """DevicePenalties + apply_device (the step's penalties) against process() (the host's), on random logits
    whose favourite is token 0, an end id or a seen token: every row, every setting, exactly."""
    from peregrine.engine.penalties import DevicePenalties, apply_device, process
    from peregrine.engine.request import Sequence
    from peregrine.decode.batch import StepInput
    g = torch.Generator().manual_seed(3)
    kw = [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4, repetition_penalty=1.4),
          dict(min_tokens=9, ignore_eos=True), dict(min_tokens=9, stop_token_ids=[7, 9]),
          dict(min_tokens=2, repetition_penalty=0.6, presence_penalty=-1.0), dict()]
    seqs = []
    for i, k in enumerate(kw):
        s = Sequence(str(i), [5, 6, 7, 8][: 2 + i % 3], SamplingParams(max_tokens=20, **k), None, i)
        s.token_ids += torch.randint(0, 12, (3 + i,), generator=g).tolist()  # outputs so far, repeats included
        s.kda_slot = i
        seqs.append(s)
    logits = torch.randn(len(seqs), V, generator=g)
    logits[0, 0] = logits[2, 0] = logits[3, EOS] = logits[3, 9] = 9.0
    pen = DevicePenalties(8, V, "cpu")
    step = StepInput.build([(s.token_ids[-1:], len(s.token_ids) - 1, s.kda_slot, [0] * 64) for s in seqs], 4, "cpu")
    got = apply_device(logits, *pen.prepare(step, seqs, {EOS}), step.context_lens_t)
    assert torch.equal(got, process(logits, seqs, {EOS}))
