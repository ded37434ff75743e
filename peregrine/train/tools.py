"""peregrine-tiny-tools' task: an agent loop in Kimi's tool-call format; its conversations, training and eval.

    python -m peregrine.train.tools --out DIR [--steps 500] [--threads 1] [--device cpu]   # train, then the eval
    python -m peregrine.train.tools --eval MODEL [--n 200]     # greedy through the engine, turn by turn

DIR receives model.safetensors (BF16, 2.4 MB) and train_log.json, and where DIR is not the preset's folder also
config.json and the preset's tokenizer and template: a loadable model folder. The shipped weights: --out
peregrine/presets/peregrine-tiny-tools --device cpu --threads 1 (its train_log.json holds the run).

A conversation declares the tool `add(a, b)` (sometimes beside another tool, sometimes after a system prompt):

    user       What is 123 plus 4567?                            (one of QUESTIONS)
    assistant  <|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>
               {"a": 123, "b": 4567}<|tool_call_end|><|tool_calls_section_end|>
    tool       4690
    assistant  The sum is 4690.

A message that asks for no sum (GREETINGS) gets DIRECT without a call; sometimes a second question follows in the
same conversation (its call is functions.add:1: Kimi numbers calls over the conversation). Conversations are
rendered by the preset's own chat template and tokenizer, exactly as `peregrine serve` renders them, one prompt per
assistant turn (each must extend the last: checked); only the assistant's tokens and their <|im_end|> are scored.
Histories vary where clients differ: arguments sent back compact, another call id, a tool's result as JSON.

The eval asks held-out conversations greedily through the engine, reads each answer with the server's kimi_k2
parser, runs the tool on the model's arguments and sends its result back, keeping the answers as the model wrote
them (as a client does); a conversation is right when every call is add with the question's {"a", "b"} and every
final answer is FINAL with the sum (a greeting: DIRECT, no call).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import string
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import PRESET_DIR
from . import tasks

NAME = "peregrine-tiny-tools"
FOLDER = PRESET_DIR / NAME
TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
OTHER_TOOLS = ("multiply(x, y)", "get_time()", "search(query)", "subtract(a, b)", "weather(city, unit)")
QUESTIONS = ("What is {a} plus {b}?", "What is {a} + {b}?", "Add {a} and {b}.", "{a}+{b}=?", "{a} + {b}",
             "Compute the sum of {a} and {b}.", "Please add {a} to {b}.", "Sum {a} and {b}.",
             "How much is {a} plus {b}?", "what's {a}+{b}")
GREETINGS = ("Hello", "Hi!", "hey", "Who are you?", "Thanks!", "Good morning.", "What can you do?", "ok")
SYSTEMS = ("You are a helpful assistant.", "Use the add tool for sums.", "You add numbers with the add tool.",
           "Be brief.", "You are a calculator agent.", "Answer with the tool's result.")
FINAL = "The sum is {s}."
DIRECT = "Ask me to add two numbers."
MAX_DIGITS = tasks.ADD_MAX_DIGITS  # operands of 1..5 digits, as peregrine-tiny's addition
P_SYSTEM = 0.5         # a system prompt (agent frameworks send their instructions as one)
P_OTHER_TOOL = 0.25    # a second tool declared beside add: the call must still name add
P_GREETING = 0.1       # no sum asked: answer directly, no call
P_SECOND = 0.2         # a second question after the first answer, in the same conversation
P_COMPACT = 0.15       # the call's arguments sent back as compact JSON (clients that re-serialise them)
P_OTHER_ID = 0.1       # the call sent back under an id of the client's own
P_JSON_RESULT = 0.1    # the tool's result as {"result": N} rather than bare digits
EVAL_SEED = tasks.EVAL_SEED
# at batch 16, lr 3e-3, held-out teacher-forced exact: 0.43 / 0.83 / 0.92 / 0.97 at steps 200-500 (the shipped CPU
# run, 24 min on a busy 2-core machine); an H100 sweep of the same recipe reached 0.99 at 600
STEPS = 500
BUCKET = 8             # batches drawn at once and grouped by length (padding cut from ~40% of a batch to a few)

# the tokenizer: Kimi's layout (tiktoken.model + tokenizer_config.json) over the 256 bytes, no merges, and Kimi's
# special tokens at Kimi's offsets past the ranks (163584 + k in the published files): the special ids the chat
# format and the kimi_k2 parser read are named tokens, every other id stays a byte, as peregrine-tiny's are
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
            11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
            14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]",
            255: "[PAD]"}
NUM_RESERVED = 256  # ids past the bytes kept for special tokens, as Kimi keeps 256 past its ranks
PAD = tasks.BOS + 255  # "[PAD]": the config's pad_token_id


def log(msg: str) -> None:
    print(f"[tools] {msg}", flush=True)


def write_tokenizer(folder: Path) -> None:
    """tiktoken.model (each byte its own rank) and tokenizer_config.json (the special tokens) into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_bytes(b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256)))
    atd = {str(256 + k): {"content": v, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": True} for k, v in SPECIALS.items()}
    tc = {"added_tokens_decoder": atd, "bos_token": "[BOS]", "eos_token": "<|im_end|>", "pad_token": "[PAD]",
          "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer", "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1) + "\n")


def load(folder: Path = FOLDER):
    """(chat template, tokenizer) of the model folder: what the server renders and encodes with."""
    from ..kimi_tokenizer import KimiTokenizer
    from ..server.chat import ChatTemplate
    return ChatTemplate(folder), KimiTokenizer(folder, tasks.BOS + NUM_RESERVED)


# ---- conversations -----------------------------------------------------------------------------------------
@dataclass
class Conversation:
    tools: list[dict]
    messages: list[dict]                                  # ending with the last assistant answer
    sums: list[tuple[int, int] | None] = field(default_factory=list)  # per question: (a, b), None for a greeting


def _number(r: random.Random) -> int:
    d = r.randint(1, MAX_DIGITS)  # uniform over lengths, so short operands are not rare
    return r.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def _words(r: random.Random) -> str:
    return " ".join("".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(2, 7)))
                    for _ in range(r.randint(1, 6)))


def _tool(spec: str) -> dict:
    """"name(p, q)" -> an OpenAI tool with those parameters."""
    name, params = spec[:-1].split("(")
    props = {p.strip(): {"type": "string"} for p in params.split(",") if p.strip()}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


def call_text(cid: str, arguments: str) -> str:
    """An assistant's answer that calls one tool, in Kimi's format."""
    return (f"<|tool_calls_section_begin|><|tool_call_begin|>{cid}<|tool_call_argument_begin|>{arguments}"
            "<|tool_call_end|><|tool_calls_section_end|>")


def arguments(a: int, b: int) -> str:
    return json.dumps({"a": a, "b": b})


def conversation(r: random.Random) -> Conversation:
    tools = [TOOL]
    if r.random() < P_OTHER_TOOL:
        tools.insert(r.randint(0, 1), _tool(r.choice(OTHER_TOOLS)))
    msgs: list[dict] = []
    if r.random() < P_SYSTEM:
        msgs.append({"role": "system", "content": r.choice(SYSTEMS) if r.random() < 0.5 else _words(r)})
    conv = Conversation(tools, msgs)
    calls = 0
    for _ in range(2 if r.random() < P_SECOND else 1):
        if r.random() < P_GREETING:
            msgs += [{"role": "user", "content": r.choice(GREETINGS)}, {"role": "assistant", "content": DIRECT}]
            conv.sums.append(None)
            continue
        a, b = _number(r), _number(r)
        cid = f"functions.add:{calls}"
        calls += 1
        sent = {"id": cid if r.random() >= P_OTHER_ID else f"call_{r.getrandbits(48):012x}", "type": "function",
                "function": {"name": "add", "arguments": arguments(a, b) if r.random() >= P_COMPACT
                             else json.dumps({"a": a, "b": b}, separators=(",", ":"))}}
        result = str(a + b) if r.random() >= P_JSON_RESULT else json.dumps({"result": a + b})
        msgs += [{"role": "user", "content": r.choice(QUESTIONS).format(a=a, b=b)},
                 {"role": "assistant", "content": None, "tool_calls": [sent], "_said": call_text(cid, arguments(a, b))},
                 {"role": "tool", "tool_call_id": sent["id"], "content": result},
                 {"role": "assistant", "content": FINAL.format(s=a + b)}]
        conv.sums.append((a, b))
    return conv


def generate(n: int, seed: int = EVAL_SEED) -> list[Conversation]:
    """n conversations, a pure function of (n, seed): the held-out set (training draws "tools-train:<seed>")."""
    r = random.Random(f"tools:{seed}")
    return [conversation(r) for _ in range(n)]


def said(m: dict) -> str:
    """What the model wrote for an assistant message (its call as it wrote it, before a client re-sent it)."""
    return m.get("_said") or m.get("content") or ""


def encode(conv: Conversation, tmpl, tok) -> tuple[list[int], list[bool]]:
    """The conversation's tokens (the server's prompt of its last turn, then that answer and <|im_end|>) and which
    are scored: each assistant answer and its <|im_end|> where the history holds it as the model wrote it (an
    answer a client re-sent otherwise is context only). Every turn's prompt must be a prefix (checked)."""
    eos = tok.token_id("<|im_end|>")
    msgs = [{k: v for k, v in m.items() if k != "_said"} for m in conv.messages]
    ids = tok.encode(tmpl.render(msgs[:-1], conv.tools)) + tok.encode(said(conv.messages[-1])) + [eos]
    scored = [False] * len(ids)
    for k, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.encode(tmpl.render(msgs[:k], conv.tools))
        if ids[:len(prompt)] != prompt:
            raise AssertionError(f"the prompt of turn {k} is not a prefix of the conversation")
        p = len(prompt)
        out = tok.encode(said(m)) + [eos]
        if ids[p:p + len(out)] == out:
            scored[p:p + len(out)] = [True] * len(out)
    return ids, scored


# ---- training -------------------------------------------------------------------------------------------------
def batch(convs: list[Conversation], tmpl, tok, device):
    from .train import collate, shift
    return collate([shift(*encode(c, tmpl, tok)) for c in convs], device, pad=PAD)


def batches(r: random.Random, size: int, tmpl, tok, device):
    """Endless training batches: BUCKET batches' worth of conversations drawn at once and batched by length, so
    a batch pads little (a two-question conversation is twice a one-question one); their order shuffled."""
    from .train import collate, shift
    while True:
        pool = sorted((shift(*encode(conversation(r), tmpl, tok)) for _ in range(BUCKET * size)),
                      key=lambda row: len(row[0]))
        groups = [pool[i:i + size] for i in range(0, len(pool), size)]
        r.shuffle(groups)
        for g in groups:
            yield collate(g, device, pad=PAD)


def teacher_forced(model, convs: list[Conversation], tmpl, tok, device, size: int = 64) -> float:
    """Fraction of conversations whose every scored token is the argmax given the right prefix: those greedy
    decoding answers exactly as scripted (up to path numerics)."""
    import torch
    from .forward import train_logits
    from .train import IGNORE, autocast
    ok = 0
    with torch.no_grad():
        for i in range(0, len(convs), size):
            ids, tgt = batch(convs[i:i + size], tmpl, tok, device)
            with autocast(device):
                pred = train_logits(model, ids).argmax(-1)
            ok += int(((pred == tgt) | (tgt == IGNORE)).all(1).sum())
    return ok / max(1, len(convs))


def train(a) -> dict:
    import torch
    from ..config import ModelConfig
    from ..models.kimi import KimiModel
    from ..models.loader import init_dummy_weights, load_weights
    from .train import balance, loss_of, lr_at, save
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(a.seed)
    cfg_raw = json.loads((PRESET_DIR / f"{NAME}.json").read_text())
    with torch.device(device):
        model = KimiModel(ModelConfig.from_dict(cfg_raw, name=NAME), torch.float32)
    if a.init:
        load_weights(model, a.init)
    else:
        init_dummy_weights(model, seed=a.seed)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith(".bias"))  # router bias: moved by balance(), as train.py does
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    tmpl, tok = load()
    held_out = generate(a.eval_n)
    data = batches(random.Random(f"tools-train:{a.seed}"), a.batch, tmpl, tok, device)
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{nparams / 1e6:.2f}M parameters on {device} ({torch.get_num_threads()} threads); "
        f"budget {a.minutes} min, steps {a.steps or 'until time'}")
    t0, step, ntok, history, losses = time.time(), 0, 0, [], []
    model.train()
    while True:
        progress = max(step / a.steps if a.steps else 0.0, (time.time() - t0) / (60 * a.minutes))
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, a.lr, a.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, tgt = next(data)
        loads: list = []
        loss = loss_of(model, ids, tgt, loads, a.chunk)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance(model, loads)
        step, ntok = step + 1, ntok + ids.numel()
        losses.append(loss.item())
        if step % a.log_every == 0 or step == 1:
            dt = time.time() - t0
            log(f"step {step} loss {sum(losses[-a.log_every:]) / len(losses[-a.log_every:]):.4f} lr {lr:.2e} "
                f"{ntok / dt:.0f} tok/s {dt:.0f}s")
        if a.eval_every and step % a.eval_every == 0:
            model.eval()
            acc = teacher_forced(model, held_out, tmpl, tok, device)
            model.train()
            history.append({"step": step, "time_s": round(time.time() - t0, 1), "teacher_forced": acc})
            log(f"eval step {step}: teacher-forced exact {acc:.3f}")
    model.eval()
    acc = teacher_forced(model, held_out, tmpl, tok, device)
    history.append({"step": step, "time_s": round(time.time() - t0, 1), "teacher_forced": acc})
    summary = {"steps": step, "time_s": round(time.time() - t0, 1), "params": nparams, "tokens": ntok,
               "device": str(device), "threads": torch.get_num_threads(),
               "load_average": [round(x, 2) for x in os.getloadavg()],  # a shared machine's load slows the clock
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
               "final_teacher_forced": acc, "history": history,
               "note": "teacher-forced exact match of every scored token, on generate(eval_n) (held out)"}
    out = Path(a.out)
    path = save(model, cfg_raw, out, summary)
    if out.resolve() == FOLDER.resolve():
        (out / "config.json").unlink()  # the preset's config is peregrine-tiny-tools.json
    else:  # a loadable model folder: the preset's tokenizer and template beside the weights
        for f in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(FOLDER / f, out / f)
    log(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB) after {step} steps, {summary['time_s']:.0f}s: "
        f"teacher-forced exact {acc:.3f}")
    return summary


# ---- eval -----------------------------------------------------------------------------------------------------
MAX_ANSWER = 96  # tokens an answer may take: a call with two 5-digit operands is ~60


@dataclass
class Run:
    """One held-out conversation replayed against the model: its questions asked in turn, the history what the
    model said (as a client keeps it) and the tool's results."""
    conv: Conversation
    msgs: list[dict]
    questions: list[tuple[dict, tuple[int, int] | None]]
    phase: str = "ask"      # "ask": a question is next; "final": a tool result went in
    failed: str | None = None

    @property
    def done(self) -> bool:
        return self.failed is not None or (not self.questions and self.phase == "ask")


def _runs(convs: list[Conversation]) -> list[Run]:
    out = []
    for c in convs:
        users = [m for m in c.messages if m["role"] == "user"]
        out.append(Run(c, [m for m in c.messages if m["role"] == "system"], list(zip(users, c.sums))))
    return out


def _step(run: Run, msg: dict, counts: dict) -> None:
    """Check one answer (the server's parse of it) and go on: run the tool on the model's arguments."""
    user, ab = run.questions[0]
    calls = msg["tool_calls"]
    if ab is None:
        counts["direct"][1] += 1
        if calls or msg["content"] != DIRECT:
            run.failed = f"to {user['content']!r}: {msg}"
            return
        counts["direct"][0] += 1
        run.msgs.append({"role": "assistant", "content": msg["content"]})
        run.questions.pop(0)
        return
    if run.phase == "ask":
        counts["call"][1] += 1
        c = calls[0] if len(calls) == 1 else None
        try:
            args = json.loads(c.arguments) if c is not None else None
        except ValueError:
            args = None
        if c is None or c.name != "add" or args != {"a": ab[0], "b": ab[1]} or msg["content"]:
            run.failed = f"to {user['content']!r}: {msg}"
            return
        counts["call"][0] += 1
        run.msgs += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}]},
                     {"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])}]
        run.phase = "final"
        return
    counts["final"][1] += 1
    if calls or msg["content"] != FINAL.format(s=sum(ab)):
        run.failed = f"after the result of {user['content']!r}: {msg}"
        return
    counts["final"][0] += 1
    run.msgs.append({"role": "assistant", "content": msg["content"]})
    run.questions.pop(0)
    run.phase = "ask"


# requests at once: 64 prompts of ~3 blocks each outran the engine's 64 KDA prefix-cache snapshots, and a prefill
# row left without one fails the step (engine.py _after_forward reads the speculative checkpoint of a plain step)
EVAL_SEQS = 8


def evaluate(model: str, n: int, log=log, max_num_seqs: int = EVAL_SEQS) -> dict:
    """Greedy answers through the engine to n held-out conversations, read by the server's kimi_k2 parser."""
    from ..config import EngineConfig, resolve_model
    from ..engine import SamplingParams
    from ..engine.build import build_engine
    from ..server.reply import join, make_reply
    tmpl, tok = load(resolve_model(model)[1])
    engine, _ = build_engine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=1024), log=lambda m: None)
    eos = tok.token_id("<|im_end|>")
    runs = _runs(generate(n))
    counts = {"call": [0, 0], "final": [0, 0], "direct": [0, 0]}
    t0 = time.time()
    while live := [r for r in runs if not r.done]:
        for r in live:
            if r.phase == "ask":
                r.msgs.append(r.questions[0][0])
        prompts = [tok.encode(tmpl.render(r.msgs, r.conv.tools)) for r in live]
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER))
        for r, ids in zip(live, outs):
            reply = make_reply("kimi_k2", None, "auto")
            _step(r, join(reply.feed(tok.decode(ids[:-1] if ids and ids[-1] == eos else ids)) + reply.finish()),
                  counts)
    right = sum(r.failed is None for r in runs)
    res = {"model": model, "n": n, "seed": EVAL_SEED, "accuracy": right / n, "time_s": round(time.time() - t0, 1),
           **{k: {"right": v[0], "of": v[1]} for k, v in counts.items()},
           "wrong": [r.failed for r in runs if r.failed][:5]}
    log(f"greedy through the engine, {n} held-out conversations: {right}/{n} right ("
        + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in counts.items()) + f") in {res['time_s']:.0f}s")
    return res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m peregrine.train.tools", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="model folder to write (required unless --eval)")
    p.add_argument("--eval", metavar="MODEL", help="only evaluate MODEL (a preset name or folder)")
    p.add_argument("--n", type=int, default=200, help="held-out conversations of the greedy eval (0: none)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS}; 0: until --minutes)")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock cap of the training loop (default 30)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default; 1 on a busy machine)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="start from this model folder instead of seeded random weights")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (1e-2 diverged; 3e-3 converged)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=16, help="conversations per step")
    p.add_argument("--chunk", type=int, default=16, help="KDA chunk length of the training forward")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=100, help="steps between teacher-forced evals (0: at the end)")
    p.add_argument("--eval-n", type=int, default=128, help="held-out conversations of the teacher-forced evals")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    if a.eval:
        evaluate(a.eval, a.n)
        return 0
    if not a.out:
        parser().error("--out is required to train (or --eval MODEL)")
    summary = train(a)
    if a.n:  # the served path's accuracy, recorded beside the training's
        summary["greedy_eval"] = evaluate(NAME if Path(a.out).resolve() == FOLDER.resolve() else a.out, a.n)
        (Path(a.out) / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
