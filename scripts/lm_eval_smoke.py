"""lm-eval-harness's `local-completions` against `peregrine serve` on peregrine-tiny: one
generate-until task whose answer only comes out right if the server honours stop strings.

The task, `peregrine_copy_until`: the tiny model copies `copy:<word>|` back (it was trained to,
then ends with EOS); every word here holds "77" (e.g. `ab77cd`), and the task's `until` is "77".
The target is the part before "77", so exact match needs the server to stop there and cut the
text before the stop string, which spans two tokens (byte-level vocabulary). lm-eval does not
trim API answers itself. The server's generated-token counter shows where generation stopped:
each answer plus the two "7" tokens, never the rest of the word or its EOS.

lm-eval lives in its own venv, not in CI (default /work/lmeval-venv, or --lm-eval BIN):
    python -m venv /work/lmeval-venv && /work/lmeval-venv/bin/pip install "lm_eval[api]==0.4.13"
    python scripts/lm_eval_smoke.py [--n 40] [--results-dir results]
Writes <date>-cpu-peregrine-tiny-lm-eval-smoke.md and the JSON lm-eval wrote (renamed alongside).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STOP = "77"
ALPHABET = "".join(c for c in string.ascii_lowercase + string.digits if c != "7")  # no stray '7' next to the stop
TASK_YAML = """task: peregrine_copy_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "copy:{{{{word}}}}|"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["{stop}"]
  max_gen_toks: 40
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def make_task(d: Path, n: int, seed: int) -> list[dict]:
    r = random.Random(f"copy_until:{seed}")
    docs = []
    for _ in range(n):
        a = "".join(r.choice(ALPHABET) for _ in range(r.randint(1, 8)))
        b = "".join(r.choice(ALPHABET) for _ in range(r.randint(1, 8)))
        docs.append({"word": f"{a}{STOP}{b}", "target": a})
    (d / "copy_until.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "peregrine_copy_until.yaml").write_text(TASK_YAML.format(data=d / "copy_until.jsonl", stop=STOP))
    return docs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=40, help="problems (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lm-eval", default=os.environ.get("LM_EVAL", "/work/lmeval-venv/bin/lm_eval"))
    p.add_argument("--results-dir", default=str(ROOT / "results"))
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmeval-smoke-"))
    docs = make_task(work, a.n, a.seed)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    serve = [sys.executable, "-m", "peregrine.cli", "serve", "--model", "peregrine-tiny", "--port", str(port),
             "--dtype", "fp32", "--max-model-len", "256", "--log-level", "warning"]
    srv = subprocess.Popen(serve, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if json.loads(get(base + "/health")).get("status") == "ok":
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("server did not come up")
        before = counter(get(base + "/metrics"), "peregrine:generation_tokens_total")
        model_args = (f"model=peregrine-tiny,base_url={base}/v1/completions,tokenizer_backend=None,"
                      "tokenized_requests=False,num_concurrent=1,max_retries=1")
        cmd = [a.lm_eval, "--model", "local-completions", "--model_args", model_args, "--tasks", "peregrine_copy_until",
               "--include_path", str(work), "--output_path", str(work / "out"), "--log_samples"]
        t0 = time.time()
        run = subprocess.run(cmd, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}, capture_output=True, text=True)
        secs = time.time() - t0
        after = counter(get(base + "/metrics"), "peregrine:generation_tokens_total")
    finally:
        srv.terminate()
        srv.wait(60)
    sys.stdout.write(run.stdout[-4000:])
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-6000:])
        return run.returncode
    res_json = sorted((work / "out").rglob("results_*.json"))[-1]
    samples = sorted((work / "out").rglob("samples_*.jsonl"))
    res = json.loads(res_json.read_text())
    em = res["results"]["peregrine_copy_until"]["exact_match,none"]
    want_tokens = sum(len(d["target"]) + len(STOP) for d in docs)  # each answer and the stop string's two tokens
    day = datetime.date.today().isoformat()
    out = Path(a.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{day}-cpu-peregrine-tiny-lm-eval-smoke"
    shutil.copy(res_json, out / f"{stem}.json")
    if samples:
        shutil.copy(samples[0], out / f"{stem}-samples.jsonl")
    lmeval_version = subprocess.run([a.lm_eval.replace("lm_eval", "python"), "-c",
                                     "import importlib.metadata as m; print(m.version('lm_eval'))"],
                                    capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    table = "\n".join(line for line in run.stdout.splitlines() if line.startswith("|"))  # lm-eval's results table
    (out / f"{stem}.md").write_text(f"""# lm-eval-harness smoke test: local-completions against peregrine serve (CPU)

Reproduce: `python scripts/lm_eval_smoke.py --n {a.n} --seed {a.seed}` (lm-eval in its own venv, see the script).

- peregrine commit `{commit}`, model peregrine-tiny (FP32 on CPU), `{' '.join(serve[2:])}`
- lm-eval {lmeval_version} (`lm_eval[api]`), torch-free; {a.n} problems, {secs:.1f} s
- lm-eval command: `lm_eval {' '.join(cmd[1:])}`
- task `peregrine_copy_until` (generate_until, until ["{STOP}"]): prompt `copy:<a>{STOP}<b>|`, target `<a>`;
  the answer is right only if the server stops at "{STOP}" (two byte tokens) and cuts the text before it.

exact_match: **{em:.3f}**

The server generated {after - before:.0f} tokens for these {a.n} requests; stopping at each "{STOP}" makes
{want_tokens} (each answer plus the two "7" tokens); without stop strings every request would go on to
copy the rest of its word and an EOS.

```
{table}
```

Files: `{stem}.json` (what lm-eval wrote), `{stem}-samples.jsonl` (every request and answer).
""")
    print(f"exact_match {em:.3f}; generated {after - before:.0f} tokens (stopping at '{STOP}': {want_tokens}); "
          f"wrote {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
