"""Checkable byte-level tasks for training and evaluating the tiny model.

Every problem is a prompt (what the user types) and an answer (what greedy
decoding must produce, followed by EOS). Formats, byte for byte:

  add     "123+4567="                → "4690"    operands of 1..ADD_MAX_DIGITS digits
  copy    "copy:abcde|"              → "abcde"   1..STR_MAX_LEN letters/digits
  reverse "rev:abcde|"               → "edcba"
  recall  "kv:" + "abcd:wxyz;" * n + "?abcd="  → "wxyz"
          n pairs (4-char keys, unique; 4-char values) fill about `context` tokens.

No BOS is prepended: `peregrine generate --prompt "12+30="` sends exactly the
prompt bytes, so training sees them the same way. Generators are pure
functions of (task, n, seed, context): a fixed seed gives the same problems on
every machine.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

BOS, EOS, PAD = 256, 257, 258  # the tiny presets' special ids (bytes are 0..255)
TASKS = ("add", "copy", "reverse", "recall")
ADD_MAX_DIGITS = 5      # issue: addition "up to maybe 5 digits"
STR_MAX_LEN = 24        # copy/reverse strings stay short: the tasks test exact transfer, not length
STR_ALPHABET = string.ascii_lowercase + string.digits
KV_LEN = 4              # recall keys and values are 4 characters
KV_PREFIX = "kv:"
PAIR_LEN = 2 * KV_LEN + 2  # "abcd:wxyz;"
DEFAULT_CONTEXT = 2048  # recall prompt length in tokens (issue: >= 2K)
EVAL_SEED = 1234        # the held-out set of `peregrine eval` and train.py's evals (training draws "train:<seed>")


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: str
    answer: str

    def prompt_ids(self) -> list[int]:
        return list(self.prompt.encode())

    def answer_ids(self) -> list[int]:
        """What greedy decoding must produce: the answer bytes, then EOS."""
        return list(self.answer.encode()) + [EOS]


def _rng(task: str, seed: int) -> random.Random:
    # string seeds hash deterministically (unlike hash()), so every task has its own stream
    return random.Random(f"{task}:{seed}")


def _word(r: random.Random, n: int) -> str:
    return "".join(r.choice(STR_ALPHABET) for _ in range(n))


def _number(r: random.Random) -> int:
    digits = r.randint(1, ADD_MAX_DIGITS)  # uniform over lengths, so short sums are not rare
    return r.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def make_add(r: random.Random) -> Problem:
    a, b = _number(r), _number(r)
    return Problem("add", f"{a}+{b}=", str(a + b))


def make_copy(r: random.Random) -> Problem:
    s = _word(r, r.randint(1, STR_MAX_LEN))
    return Problem("copy", f"copy:{s}|", s)


def make_reverse(r: random.Random) -> Problem:
    s = _word(r, r.randint(1, STR_MAX_LEN))
    return Problem("reverse", f"rev:{s}|", s[::-1])


def recall_pairs(r: random.Random, context: int) -> list[tuple[str, str]]:
    """Unique random keys with random values, about `context` tokens of "k:v;" text."""
    n = max(1, (context - len(KV_PREFIX) - KV_LEN - 2) // PAIR_LEN)
    keys: dict[str, str] = {}
    while len(keys) < n:
        keys.setdefault(_word(r, KV_LEN), _word(r, KV_LEN))
    return list(keys.items())


def recall_context(pairs: list[tuple[str, str]]) -> str:
    return KV_PREFIX + "".join(f"{k}:{v};" for k, v in pairs)


def make_recall(r: random.Random, context: int = DEFAULT_CONTEXT) -> Problem:
    pairs = recall_pairs(r, context)
    k, v = r.choice(pairs)
    return Problem("recall", f"{recall_context(pairs)}?{k}=", v)


def generate(task: str, n: int, seed: int, context: int = DEFAULT_CONTEXT) -> list[Problem]:
    """n problems of one task, a pure function of the arguments."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")
    r = _rng(task, seed)
    if task == "recall":
        return [make_recall(r, context) for _ in range(n)]
    make = {"add": make_add, "copy": make_copy, "reverse": make_reverse}[task]
    return [make(r) for _ in range(n)]


def check(problem: Problem, output_ids: list[int]) -> bool:
    """Exact match: the output is the answer bytes followed by EOS (nothing else before EOS)."""
    want = problem.answer_ids()
    return list(output_ids[: len(want)]) == want


def max_new_tokens(problem: Problem) -> int:
    """Enough to see the whole answer and its EOS, and no more (a wrong answer stops early)."""
    return len(problem.answer_ids())
