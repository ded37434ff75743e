"""Structured output and logit_bias in the engine (peregrine/engine/guided.py): every constrained output parses and
validates against its own grammar (jsonschema for JSON schemas, re for patterns), over sampled seeds and greedy, on
the standard path (the host draws) and the specialized one (the draw inside the step, decode/head.py); a constrained
or biased row leaves its batch's other answers unchanged; logit_bias against the host's own arithmetic; a grammar cut
by max_tokens ends with "length"; a grammar that cannot be compiled is that request's error, naming its field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from conftest import FULL_SHAPES, dummy_model_dir
from peregrine.config import PRESET_DIR, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.engine.request import GuidedDecoding, RequestError
from test_specialized import MICRO

pytestmark = pytest.mark.gpu  # device-agnostic: the GPU pass runs it with the decode graphs' constrained variants

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["a", "n", "ok"], "additionalProperties": False}
PATTERN = r"[a-c]{3}-\d\d"
CHOICES = ["red", "green", "blue"]
EBNF = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
MAX = 160  # tokens: the random model's whitespace runs included, every grammar here ends well inside it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    raw.update(MICRO)  # the byte-level tokenizer over a 300-token vocabulary
    return dummy_model_dir(tmp_path_factory, raw, "guided", seed=7)


def engine(model_dir, backend="standard", **kw):
    e, tok = build_engine(model_dir, EngineConfig(decode_backend=backend, max_num_seqs=8, max_model_len=512, **kw),
                          log=lambda m: None)
    return e


def run(e, requests: dict) -> dict:
    """{id: (prompt, params)} all at once -> {id: (text without the end token, finish reason, token ids)}."""
    out = {}
    for rid, (prompt, p) in requests.items():
        e.add_request(prompt, p, request_id=rid,
                      on_token=lambda o: o.finished and out.__setitem__(o.request_id, o))
    while e.has_unfinished():
        e.step()
    eos = set(e.model_cfg.eos_token_ids)
    return {r: (e.tokenizer.decode([t for t in o.output_token_ids if t not in eos]), o.finish_reason,
                o.output_token_ids) for r, o in out.items()}


def guided(kind, spec=None, **kw):
    return SamplingParams(max_tokens=MAX, guided=GuidedDecoding(kind, spec), **kw)


def check(kind, spec, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in spec
    else:
        assert re.fullmatch(r"\(\d+\)", text), text


CASES = [("json", SCHEMA), ("json_object", None), ("regex", PATTERN), ("choice", CHOICES), ("grammar", EBNF)]
# JSON allows any whitespace between tokens (vLLM's default too): a dummy model's greedy choice can be a space
# forever, so JSON grammars are checked on sampled rows
WHITESPACE = ("json", "json_object")
HOT = 3.0  # the dummy model's sharpened lm_head (conftest) leans to one token: a flatter draw ends JSON sooner


@pytest.mark.parametrize("backend", ["standard", "latency_specialized"])
def test_outputs_follow_their_grammars_beside_unconstrained_rows(model_dir, backend):
    """Greedy and sampled constrained rows with unconstrained ones in one batch: each constrained output ends ("stop")
    inside its grammar; the unconstrained rows answer what they answer alone. The specialized path (its draw inside
    the step, through the interpreter on the CPU) takes the grammars of short answers."""
    e = engine(model_dir, backend)
    short = backend == "latency_specialized" and not FULL_SHAPES
    free = {f"free{i}": ([11 + i, 12, 13], SamplingParams(max_tokens=12 if not short else 4, ignore_eos=True))
            for i in range(1 if short else 2)}
    alone = run(e, free)
    reqs = dict(free)
    for i, (kind, spec) in enumerate(CASES):
        if short and kind not in ("regex", "choice"):
            continue
        if kind not in WHITESPACE:
            reqs[f"{kind}-greedy"] = ([20 + i, 21], guided(kind, spec))
        for seed in range(1 if short else 2):
            reqs[f"{kind}-sampled{seed}"] = ([30 + i, 31], guided(kind, spec, temperature=HOT, seed=seed))
    got = run(e, reqs)
    for rid, (prompt, p) in reqs.items():
        if p.guided is not None:
            text, reason, _ = got[rid]
            if p.guided.kind == "json_object" and reason == "length":  # any object: random keys and strings may run on
                assert text.startswith("{")
                continue
            assert reason == "stop", (rid, text)
            check(p.guided.kind, p.guided.spec, text)
    for rid in free:
        assert got[rid][2] == alone[rid][2]
    if backend == "latency_specialized":
        assert e.stats["steps_by_path"]["latency_specialized"] > 0


def test_logit_bias_against_the_host_arithmetic(model_dir):
    """+100 on a token makes greedy take it; -100 on a greedy choice removes it (the next best instead, as the raw
    logits order them); a biased row's neighbours are unchanged."""
    e = engine(model_dir)
    prompt = [40, 41, 42]
    plain = run(e, {"p": (prompt, SamplingParams(max_tokens=1, ignore_eos=True))})["p"][2][0]
    logits = {}
    fwd = e.runner.forward
    e.runner.forward = lambda st: logits.setdefault("x", fwd(st))
    run(e, {"p": (prompt, SamplingParams(max_tokens=1, ignore_eos=True))})
    e.runner.forward = fwd
    second = int(logits["x"][-1].topk(2).indices[1])
    got = run(e, {"up": (prompt, SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={77: 100.0})),
                  "ban": (prompt, SamplingParams(max_tokens=1, ignore_eos=True, logit_bias={plain: -100.0})),
                  "free": ([5, 6], SamplingParams(max_tokens=4, ignore_eos=True))})
    assert got["up"][2] == [77] * 4
    assert got["ban"][2] == [second]
    assert got["free"][2] == run(e, {"free": ([5, 6], SamplingParams(max_tokens=4, ignore_eos=True))})["free"][2]


def test_on_the_device_path_and_with_lookahead():
    """The FakeRunner's "device" draws (for the biased row xgrammar's own masking, not peregrine's): both keep decode
    lookahead, a constrained row's draw coming after its step (its mask filled while the step runs, from the tokens
    the step before gave), and both draw what the host path draws."""
    from peregrine.tokenizer import ByteTokenizer
    from test_lookahead import make_engine
    outs = {}
    for greedy_runner in (True, False):
        e, runner, _ = make_engine(True)
        e.tokenizer = ByteTokenizer(e.model_cfg.vocab_size)
        if not greedy_runner:
            runner.lookahead = runner.device_sampler = False
            e.lookahead = e.device_sampling = False
        runner.prompts = [(1, 2, 3), (4, 5)]
        reqs = {"bias": ([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={65: 5.0, 66: -100.0})),
                "re": ([4, 5], SamplingParams(max_tokens=20, guided=GuidedDecoding("regex", r"[a-d]{4,9}")))}
        outs[greedy_runner] = run(e, reqs), e.stats["lookahead_steps"], runner.constrained_steps, runner.deferred_steps
    (dev, la, constrained, deferred), (host, *_) = outs[True], outs[False]
    assert dev == host and la > 0 and constrained > 0 and deferred > 0  # the grammar's draws after the step
    assert re.fullmatch(r"[a-d]{4,9}", dev["re"][0]) and 66 not in dev["bias"][2]


def test_a_grammar_cut_by_max_tokens_ends_with_length(model_dir):
    e = engine(model_dir)
    got = run(e, {"j": ([7, 8], SamplingParams(max_tokens=3, guided=GuidedDecoding("json", SCHEMA)))})["j"]
    assert got[1] == "length" and len(got[2]) == 3 and got[0].startswith("{")


@pytest.mark.parametrize("kind,spec,field", [
    ("json", {"type": "object", "properties": {"a": {"type": "no-such-type"}}}, "response_format"),
    ("regex", "([a-z", "structured_outputs"), ("choice", [], "structured_outputs"), ("grammar", "root ::= (", "tools"),
])
def test_a_grammar_that_cannot_be_compiled_is_the_requests_error(model_dir, kind, spec, field):
    e = engine(model_dir)
    with pytest.raises(RequestError) as err:
        e.add_request([1, 2], SamplingParams(guided=GuidedDecoding(kind, spec, field)))
    assert err.value.param == field and field in str(err.value)
    assert not e.has_unfinished()
    with pytest.raises(RequestError, match="forced_tokens"):
        e.add_request([1, 2], SamplingParams(max_tokens=2, guided=GuidedDecoding("json_object")), forced=[3])
    assert run(e, {"ok": ([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))})["ok"][1] == "length"


def test_speculation_beside_a_constrained_row(model_dir):
    """Speculation (scripted drafts, rejections included) with a constrained row in the batch, which a drafter without
    text for it leaves undrafted: it stays in its grammar; the other answers what it answers without speculation."""
    from spec_helpers import ScriptedDrafter
    cfg = {"method": "ngram", "num_speculative_tokens": 3}
    plain, spec = engine(model_dir), engine(model_dir, speculative_config=cfg)
    rep = ([9, 8, 7] * 6, SamplingParams(max_tokens=16, ignore_eos=True))
    want = run(plain, {"r": rep})["r"][2]
    spec.enable_speculation(cfg, drafter=ScriptedDrafter({tuple(rep[0]): want, (3, 3): []}, [2, 0, 3],
                                                         spec.model_cfg.vocab_size, strict=False))
    got = run(spec, {"r": rep, "c": ([3, 3], guided("choice", CHOICES))})
    assert got["r"][2] == want and got["c"][0] in CHOICES and spec.stats["spec"]["verify_steps"] > 0


def test_constrained_and_biased_rows_speculate_inside_their_grammar(model_dir):
    """Scripted drafts for constrained and biased rows: each verified position is masked by its grammar after the
    drafts before it (a draft the grammar refuses, and those after it, never verified) and biased; the outputs equal
    the same requests' without speculation, and drafts were accepted."""
    from spec_helpers import ScriptedDrafter
    cfg = {"method": "ngram", "num_speculative_tokens": 3}
    reqs = {"re": ([4, 5], SamplingParams(max_tokens=20, guided=GuidedDecoding("regex", r"[a-d]{6,12}"))),
            "g": ([6, 7], guided("grammar", EBNF)),
            "b": ([8, 9], SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={65: 4.0, 66: -100.0})),
            "s": ([1, 2], guided("choice", CHOICES, temperature=HOT, seed=3))}
    want = run(engine(model_dir), reqs)
    spec = engine(model_dir, speculative_config=cfg)
    dr = ScriptedDrafter({tuple(p): want[r][2] for r, (p, _) in reqs.items()}, [2, 0, 3, 1], spec.model_cfg.vocab_size)
    spec.enable_speculation(cfg, drafter=dr)
    got = run(spec, reqs)
    assert {r: v[2] for r, v in got.items()} == {r: v[2] for r, v in want.items()}
    assert spec.stats["spec"]["num_accepted_tokens"] > 0
    check("regex", r"[a-d]{6,12}", got["re"][0])
    assert 66 not in got["b"][2]


def test_a_draft_the_grammar_refuses_is_not_verified(model_dir):
    from peregrine.speculative.decoder import SpecDecoder
    e = engine(model_dir)
    m = e._guides().matcher(GuidedDecoding("regex", r"ab+c"))

    class Seq:
        guide = m
    a, b, c = (e.tokenizer.encode(x)[0] for x in "abc")
    assert SpecDecoder._in_grammar(Seq, [a, b, b, a, c]) == [a, b, b]  # the second "a" is refused
    assert m.accept_token(a) and m.accept_token(b) and m.accept_token(c)  # the matcher was stepped back to its start
