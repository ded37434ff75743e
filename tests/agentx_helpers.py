"""Shared by tests/test_aiperf.py and tests/test_agentx_bench.py: the model folder aiperf's AgentX scenario runs
against, a `peregrine serve` of it, and the scenario's aiperf run on tests/agentx/traces.

The model: tiny-kimi-linear with dummy weights in a folder the test writes, whose chat template renders the whole
conversation (peregrine-tiny's keeps only the last user message), so each turn's prompt extends the last one token
for token; its tokenizer gives every id one character (ASCII keeps its byte value), so any reply of random weights
is text and aiperf and the server count the same tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
TRACES = ROOT / "tests" / "agentx" / "traces"
PRESET = ROOT / "peregrine" / "presets" / "tiny-kimi-linear.json"
NAME = "tiny-kimi-linear-chat"
LIMIT = 600.0           # generous bound on a server's start and on a whole aiperf run
NO_AIPERF = (f"{AIPERF.relative_to(ROOT)} is missing: bash scripts/setup.sh installs aiperf there "
             "(requirements-aiperf.txt)")

# ---- the model folder: the preset's config, a one-character-per-id tokenizer, a whole-conversation template ----
SPECIALS = {256: "[BOS]", 257: "[EOS]", 258: "[PAD]",  # the preset's bos / eos / pad ids
            259: "<|im_system|>", 260: "<|im_user|>", 261: "<|im_assistant|>", 262: "<|im_tool|>", 263: "<|im_end|>"}
TEMPLATE = ("{%- for m in messages -%}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{%- endfor -%}"
            "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}")


def _char(i: int) -> str:
    """Token i's text: itself for printable ASCII and tab / newline / CR, else a Latin letter from U+0100 on (so no
    id decodes to nothing or to half a character); id 0 is the em dash aiperf's coding corpus uses."""
    if i == 0:
        return "\u2014"
    return chr(i) if 32 <= i < 127 or chr(i) in "\t\n\r" else chr(0x100 + i)


def write_model(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models
    raw = json.loads(PRESET.read_text())
    vocab = {_char(i): i for i in range(raw["vocab_size"]) if i not in SPECIALS} | {s: i for i, s in SPECIALS.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: a character a token, text concatenates
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in sorted(SPECIALS.items())])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({  # what transformers' AutoTokenizer (aiperf) reads
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[PAD]"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)


@contextmanager
def served(model: Path, log: Path):
    """`peregrine serve` of the model folder (dummy weights, NAME) until the block ends; -> its base URL."""
    from conftest import start_server
    server, url = start_server(["--model", str(model), "--dummy-weights", "--served-model-name", NAME,
                                "--max-num-seqs", "4", "--log-level", "warning"], timeout=LIMIT, log=log)
    try:
        yield url
    finally:
        server.kill()
        server.wait(30)


def run_aiperf(url: str, model: Path, tmp: Path, profile_s: int, concurrency: int = 4,
               seed: int = 1) -> tuple[Path, str]:
    """aiperf's AgentX scenario on TRACES against url; -> (artifact dir, aiperf's log). The scenario's rules hold but
    two a CPU run breaks (--unsafe-override makes them warnings): a local trace folder and profile_s < 900 s."""
    art = tmp / "artifacts"
    cmd = [str(AIPERF), "profile", "--scenario", "inferencex-agentx-mvp",
           "--unsafe-override",  # the two broken rules become warnings
           "--url", url, "--endpoint-type", "chat", "--model", NAME,
           "--tokenizer", str(model),  # aiperf rebuilds every prompt from the traces' blocks with it
           "--input-file", str(TRACES), "--custom-dataset-type", "weka_trace",
           "--concurrency", str(concurrency),  # one lane per session at 4
           "--use-server-token-count",  # as InferenceX: output lengths from the server's usage
           "--benchmark-duration", str(profile_s),
           "--benchmark-grace-period", str(int(LIMIT)),  # requests in flight at the end finish (default 30 s)
           "--random-seed", str(seed),  # the lanes' start instants; the scenario would draw a seed
           "--workers-max", "1", "--record-processor-service-count", "1",  # 2 cores, shared
           "--no-gpu-telemetry", "--ui", "none",
           "--export-level", "raw",  # request bodies too, to check what was asked
           "--artifact-dir", str(art)]
    env = {**os.environ,
           "AIPERF_DATASET_MMAP_CACHE_ENABLED": "false",  # no dataset left in ~/.cache or reused from one
           "AIPERF_DATASET_MMAP_BASE_PATH": str(tmp)}
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # with either, aiperf 0.13.0 looks even a local
        env.pop(k, None)                                   # tokenizer folder up in the hub's cache, and fails
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=LIMIT)
    log = (art / "logs" / "aiperf.log").read_text() if (art / "logs" / "aiperf.log").exists() else ""
    assert r.returncode == 0, (f"aiperf failed ({r.returncode}): {r.stdout[-2000:]}\n{r.stderr[-2000:]}\n"
                               f"{log[-3000:]}")
    return art, log


def records(art: Path, name: str) -> list[dict]:
    """An aiperf export's records (profile_export.jsonl, profile_export_raw.jsonl)."""
    return [json.loads(line) for line in (art / name).read_text().splitlines() if line.strip()]
