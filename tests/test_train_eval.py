"""Training tasks, the differentiable training forward against the inference model,
a 2-step training smoke run, and `peregrine eval` (accuracy and side-by-side)."""
import argparse
import json
import re

import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.cache import ModelCache
from peregrine.config import PRESET_DIR, ConfigError, EngineConfig, ModelConfig
from peregrine.decode.batch import StepInput
from peregrine.models.kimi import KimiModel
from peregrine.models.loader import init_dummy_weights
from peregrine.testing import rel_rmse
from peregrine.train import tasks
from peregrine.train.forward import chunk_kda, train_logits

pytestmark = pytest.mark.gpu
TOL = 1e-4  # FP32 chunked vs recurrent: different summation order only


# ---- tasks -------------------------------------------------------------------
@pytest.mark.parametrize("task", tasks.TASKS)
def test_generators_deterministic_and_answers_correct(task):
    ctx = 300
    a, b = tasks.generate(task, 50, 7, ctx), tasks.generate(task, 50, 7, ctx)
    assert a == b and a != tasks.generate(task, 50, 8, ctx)
    for p in a:
        if task == "add":
            x, y = re.fullmatch(r"(\d+)\+(\d+)=", p.prompt).groups()
            assert int(p.answer) == int(x) + int(y) and max(len(x), len(y)) <= tasks.ADD_MAX_DIGITS
        elif task == "copy":
            assert p.prompt == f"copy:{p.answer}|"
        elif task == "reverse":
            assert p.prompt.startswith("rev:") and p.prompt[4:-1][::-1] == p.answer and p.prompt[-1] == "|"
        else:
            body, key = re.fullmatch(r"kv:(.*)\?(\w{4})=", p.prompt).groups()
            pairs = [kv.split(":") for kv in body.rstrip(";").split(";")]
            d = dict(pairs)
            assert len(d) == len(pairs) and d[key] == p.answer  # keys unique, the answer is the key's value
            assert ctx - tasks.PAIR_LEN <= len(p.prompt_ids()) <= ctx
        assert tasks.check(p, p.answer_ids()) and tasks.check(p, p.answer_ids() + [5])
        assert not tasks.check(p, p.answer_ids()[:-1])            # no EOS: not an answer
        assert not tasks.check(p, [ord("x")] + p.answer_ids())


def test_recall_context_lengths_and_odd_sizes():
    for ctx in (1, 3, 100, 2048):
        p = tasks.generate("recall", 1, 0, ctx)[0]
        assert len(p.prompt_ids()) <= max(ctx, len("kv:") + tasks.PAIR_LEN + tasks.KV_LEN + 2)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.generate("mul", 1, 0)


# ---- chunked KDA == recurrence -------------------------------------------------
def recurrent_kda(q, k, v, g, beta, S0):
    """Independent FP32 reference: the docs/models.md recurrence, token by token."""
    S, outs = S0.clone(), []
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("T,chunk", [(1, 32), (3, 2), (7, 4), (100, 4), (100, 16), (100, 32), (257, 8)] + ([(2049, 32)] if FULL_SHAPES else []))
def test_chunk_kda_equals_recurrence(T, chunk, device):
    g0 = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 3, 16, 8
    rnd = lambda *s: torch.randn(*s, generator=g0)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    # per-head decay from almost none to exp(-30) per step: strong decays must underflow, not overflow
    g = -torch.rand(B, T, H, K, generator=g0) * torch.tensor([0.01, 1.0, 30.0]).view(1, 1, H, 1)
    beta = torch.rand(B, T, H, generator=g0)
    S0 = rnd(B, H, K, V)
    ref_o, ref_S = recurrent_kda(q, k, v, g, beta, S0)
    args = [x.to(device).requires_grad_() for x in (q, k, v, g, beta, S0)]
    o, S = chunk_kda(*args[:5], S0=args[5], chunk=chunk)
    assert torch.isfinite(o).all() and rel_rmse(o.cpu(), ref_o) < TOL and rel_rmse(S.cpu(), ref_S) < TOL
    (o.sum() + S.sum()).backward()
    assert all(torch.isfinite(a.grad).all() for a in args)


# ---- training forward == inference forward ------------------------------------
def tiny_model(name="tiny-kimi-linear", seed=3, device="cpu"):
    cfg = ModelConfig.from_json(PRESET_DIR / f"{name}.json")
    with torch.device(device):
        m = KimiModel(cfg, torch.float32).eval()
    init_dummy_weights(m, seed)
    return cfg, m


@pytest.mark.parametrize("name", ["tiny-kimi-linear", "peregrine-tiny"])
def test_train_forward_equals_inference_forward(name, device):
    cfg, m = tiny_model(name, device=device)
    lens = [100 if FULL_SHAPES else 45, 7, 1, 3]
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    ids = torch.full((len(lens), max(lens)), tasks.PAD)
    for i, t in enumerate(toks):  # right padding must not leak into the real tokens
        ids[i, :len(t)] = torch.tensor(t)
    with torch.no_grad():
        tl = train_logits(m, ids.to(device), chunk=16).cpu()
    BS = 4
    for i, t in enumerate(toks):
        c = ModelCache(cfg, num_blocks=32, block_size=BS, num_slots=2, dtype=torch.float32, device=device)
        rec = []
        with torch.inference_mode():
            last = m(StepInput.build([(t, 0, c.allocate_slot(), list(range(30, 30 - (len(t) + BS - 1) // BS, -1)))], BS, device),
                     c, record=rec)
            every = m.compute_logits(rec[-1])
        assert rel_rmse(tl[i, :len(t)], every.cpu()) < TOL, f"sequence {i} (len {len(t)}) all positions"
        assert rel_rmse(tl[i, len(t) - 1], last[0].cpu()) < TOL, f"sequence {i} last token"


def test_train_forward_is_differentiable_everywhere():
    cfg, m = tiny_model()
    for p in m.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(1))
    loads = []
    train_logits(m, ids, loads).logsumexp(-1).mean().backward()
    assert len(loads) == len(cfg.moe_layers) and all(int(x.sum()) == 2 * 19 * cfg.num_experts_per_token for x in loads)
    for name, p in m.named_parameters():
        if name.endswith(".bias"):  # router correction bias: only picks experts, gets no gradient
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---- training smoke run --------------------------------------------------------
def test_two_step_training_writes_a_checkpoint_the_engine_runs(tmp_path, device):
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    from peregrine.train.train import main

    out = tmp_path / "ckpt"
    assert main(["--out", str(out), "--steps", "2", "--device", device, "--batch", "4", "--recall-tokens", "96",
                 "--recall-max-context", "96", "--eval-n", "1", "--eval-context", "64", "--log-every", "1"]) == 0
    assert (out / "model.safetensors").stat().st_size <= 25e6
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2 and set(log["final"]) == set(tasks.TASKS)
    eng, tok = build_engine(str(out), EngineConfig(device=device, dtype="fp32"), log=lambda m: None)
    outs = eng.generate([tok.encode("12+30=")], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0]) == 4


# ---- peregrine eval ------------------------------------------------------------
def eval_cli(argv):
    from peregrine.eval import add_eval_parser
    p = argparse.ArgumentParser()
    add_eval_parser(p.add_subparsers())
    a = p.parse_args(["eval"] + argv)
    return a.func(a)


def test_eval_end_to_end_writes_json(tmp_path, capsys):
    rc = eval_cli(["--model", "tiny-kimi-linear", "--dummy-weights", "--task", "add", "--n", "5",
                   "--results-dir", str(tmp_path), "--quiet"])
    assert rc == 0 and "accuracy" in capsys.readouterr().out
    (f,) = tmp_path.glob("*-tiny-kimi-linear-eval-add.json")
    r = json.loads(f.read_text())
    assert r["n"] == 5 and 0 <= r["accuracy"] <= 1 and len(r["outputs"]) == 5 and "commit" in r["meta"]
    from peregrine.eval import run_eval
    r = run_eval("tiny-kimi-linear", "recall", n=2, context=64, dummy_weights=True, results_dir=None)
    assert r["path"] is None and r["context"] == 64 and len(r["outputs"]) == 2


def test_compare_detects_differences_and_passes_identical(tmp_path, capsys, monkeypatch):
    import peregrine.eval as ev
    same = ev.compare("tiny-kimi-linear", "add", 3, EngineConfig(), EngineConfig(max_num_seqs=1), dummy_weights=True,
                      results_dir=None, strict=True)  # batching must not change answers
    assert same["identical"] and same["num_different"] == 0
    # different dummy weights really change the answers: the CLI must fail loudly
    base = ["--model", "tiny-kimi-linear", "--dummy-weights", "--task", "add", "--n", "3", "--results-dir", str(tmp_path), "--quiet"]
    assert eval_cli(base + ["--compare", '{"seed": 1}']) == 1
    assert "ANSWER MISMATCH" in capsys.readouterr().err
    assert eval_cli(base + ["--compare", '{"seed": 1}', "--tolerance-points", "100"]) == 0  # accuracy-only gate
    (f,) = tmp_path.glob("*-eval-add-compare-*.json")  # named by what B changes: runs of other comparisons keep theirs
    assert f.name.endswith("-eval-add-compare-seed-1.json"), f.name
    r = json.loads(f.read_text())
    assert r["identical"] is False and r["num_different"] >= 1 and r["b"]["seed"] == 1
    # one injected difference among identical answers is caught too
    calls = []
    monkeypatch.setattr(ev, "answers", lambda m, probs, *a, **k: calls.append(1) or
                        [p.answer_ids() if len(calls) == 1 or i != 2 else p.answer_ids()[:-1] + [ord("0")]
                         for i, p in enumerate(probs)])
    with pytest.raises(ev.AnswerMismatch, match="1/5 answers differ"):
        ev.compare("tiny-kimi-linear", "add", 5, None, None, results_dir=None, strict=True)
    with pytest.raises(ConfigError, match="unknown key"):
        eval_cli(base + ["--compare", '{"bogus": 1}'])


def test_shipped_peregrine_tiny_answers_held_out_problems():
    """The committed weights load through the real engine and answer problems they never saw
    (the task generator, not the model, says what is right)."""
    from peregrine.eval import run_eval
    assert (PRESET_DIR / "peregrine-tiny" / "model.safetensors").is_file()
    r = run_eval("peregrine-tiny", "copy", n=12, context=0, dummy_weights=False, results_dir=None)
    assert r["accuracy"] >= 0.9, r["wrong"][:3]
    r = run_eval("peregrine-tiny", "recall", n=4, context=256, dummy_weights=False, results_dir=None)
    assert r["accuracy"] >= 0.75, r["wrong"][:3]
