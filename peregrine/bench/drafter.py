"""python -m peregrine.bench.drafter: the DFlash / DSpark drafter's propose step (dflash_graphs.py), replayed
from its CUDA graph against the same padded step run eagerly, per batch size and context length.

Random weights of a drafter shape (`--shape`): "tiny" is the shipped peregrine-tiny-dspark's; "48b" is a 5-layer
drafter of hidden 2304 over the 48B's vocabulary (the public Kimi-Linear DFlash drafter's layers, hidden size and
block; its head counts and MLP width are not published: 32 / 8 heads of 128 and 9216 are assumed here). Timed: the
whole propose as the engine calls it (inputs copied in, drafts and confidences read back), host clock around a
synchronised call, three ways: the step's graph with the context read in place (kernels/drafter_attn.py), the
same step launched eagerly, and the graph of the step that gathers the context first. Bytes per propose: every
weight once plus the context's keys and values (at the padded length); GB/s and % of the copy bandwidth measured
in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from . import gpu

SHAPES = {
    "tiny": None,  # read from peregrine/presets/peregrine-tiny-dspark
    "48b": {"architectures": ["Qwen3DSparkModel"], "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "block_size": 16,
            "mask_token_id": 163839, "target_layer_ids": [3, 7, 15, 19, 23], "num_target_layers": 27,
            "vocab_size": 163840, "markov_rank": 32, "enable_confidence_head": True},
}
ITERS, WARMUP = 20, 3


def _model(shape: str, dev):
    from ..speculative.dflash import DFlashConfig, DFlashModel, drafter_dir
    if shape == "tiny":
        folder = drafter_dir("peregrine-tiny-dspark")
        d = json.loads((folder / "config.json").read_text())
    else:
        d = dict(SHAPES[shape])
    cfg = DFlashConfig.from_dict(d, shape)
    V = d.get("vocab_size") or 320
    g = torch.Generator().manual_seed(0)
    H = cfg.hidden_size
    emb = (torch.randn(V, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    head = (torch.randn(V, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    m = DFlashModel(cfg, {}, emb, head)
    m.w = {k: (torch.randn(s, generator=g) * (1.0 if len(s) == 1 else s[-1] ** -0.5)).to(dev, torch.bfloat16)
           for k, s in m.names().items()}
    for k in m.w:
        if k.endswith("norm.weight"):
            m.w[k].fill_(1.0)
    return m


MODES = {"graph": (True, None), "eager": (False, None), "graph_gather": (True, False)}  # capture, paged (None: where
# the kernels run): the paged step replayed, the same launched eagerly, and the gathered-context step replayed


def run(shape: str, batches, lengths, log=print, iters: int = ITERS, k: int | None = None, paged=None) -> dict:
    """On the CPU (the smoke test) the same steps run eagerly, with no copy bandwidth to compare against; paged
    False there keeps the interpreter out of it."""
    from ..speculative.dflash import TapWriter
    from ..speculative.dflash_graphs import DrafterGraphs, bucket
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    copy = gpu.copy_bandwidth() if on_gpu else None
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    m = _model(shape, dev)
    cfg, bs = m.cfg, 16
    k = min(k or cfg.num_drafts, cfg.num_drafts)  # drafts a propose (the engine's num_speculative_tokens)
    slots = max(batches) * (max(lengths) + bs)
    w = TapWriter(m, slots, torch.bfloat16, dev)
    w.kv.normal_()
    wbytes = sum(t.numel() * t.element_size() for t in m.w.values()) + m.lm_head.numel() * m.lm_head.element_size()
    out = {"kind": "drafter_step", "shape": shape, "config": vars(cfg), "metadata": gpu.run_metadata(),
           "copy_bandwidth": copy, "weight_bytes": wbytes, "k": k, "rows": []}
    log(f"drafter {shape}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, block {cfg.block_size}, k {k}; "
        f"weights {wbytes / 1e6:.0f} MB" + (f"; copy {copy['gbps']:.0f} GB/s" if copy else ""))
    for L in lengths:
        for B in batches:
            blocks = [list(range(b * (-(-L // bs)), (b + 1) * (-(-L // bs)))) for b in range(B)]
            lens, anchors = [L] * B, list(range(1, B + 1))
            row = {"batch": B, "context": L, "bucket": bucket(L, max(lengths))}
            kv_bytes = B * row["bucket"] * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
            for mode, (cap, pg) in MODES.items():
                pg = paged if pg is None else pg
                dg = DrafterGraphs(m, w, bs, k, max(lengths), dev, capture=on_gpu and cap, log=log, paged=pg)
                samples = []
                for i in range(WARMUP + iters):
                    sync()
                    t0 = time.perf_counter()
                    dg.draft(blocks, lens, anchors)  # reads back: synchronised
                    if i >= WARMUP:
                        samples.append((time.perf_counter() - t0) * 1e3)
                med = statistics.median(samples)
                gbps = (wbytes + kv_bytes) / med / 1e6
                row[mode] = {"median_ms": med, "samples_ms": samples, "gbps": gbps, "paged": dg.paged,
                             "pct_copy_bw": gbps / copy["gbps"] * 100 if copy else None, "captured": dg.replays > 0}
                del dg
            row["graph_vs_eager"] = row["graph"]["median_ms"] / row["eager"]["median_ms"]
            out["rows"].append(row)
            pct = row["graph"]["pct_copy_bw"]
            log(f"  B={B} L={L}: graph {row['graph']['median_ms']:.3f} ms"
                + (f" ({pct:.0f} % of copy)" if pct is not None else " (not captured: no GPU)")
                + f", eager {row['eager']['median_ms']:.3f} ms, gathered context {row['graph_gather']['median_ms']:.3f} ms")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="48b", help="drafter shape (default 48b)")
    ap.add_argument("--batches", default="1,4,8", help="batch sizes (default 1,4,8)")
    ap.add_argument("--lengths", default="1024,8192,32768", help="context lengths (default 1024,8192,32768)")
    ap.add_argument("--k", type=int, default=None, help="drafts a propose (default: the block's, all slots)")
    ap.add_argument("--results-dir", default="results", help="where the JSON goes (default results)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the step is timed as CUDA graphs against eager launches)")
    try:
        batches = [int(x) for x in a.batches.split(",") if x]
        lengths = [int(x) for x in a.lengths.split(",") if x]
    except ValueError:
        ap.error("--batches and --lengths take comma-separated integers")
    if not batches or not lengths or min(batches + lengths) <= 0:
        ap.error("--batches and --lengths must be positive")
    if a.k is not None and a.k <= 0:
        ap.error("--k must be positive")
    res = run(a.shape, batches, lengths, k=a.k)
    path = gpu.write_result(gpu.result_path(f"drafter-{a.shape}", f"step-k{res['k']}", a.results_dir), res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
