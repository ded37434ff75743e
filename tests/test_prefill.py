"""Prefill for agent-size prompts: KDA snapshots taken inside a chunk, prefix-cache hit == miss on the
real (tiny) model, and on the GPU the fast kernels (fla's chunk_kda) against the recurrent reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from peregrine.cache import ModelCache
from peregrine.config import EngineConfig
from peregrine.decode.batch import StepInput
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.testing import rel_rmse
from test_model import BS, decode_all, new_cache, run, tiny

LM_HEAD_SCALE = 4.0  # dummy logits sharpened: confident greedy choices, as a trained model makes


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_in_chunk_snapshots_equal_the_state_at_that_position(model):
    """One 150-token chunk that snapshots after 64, 101 and 149 tokens: each snapshot equals the state
    (and conv window) of a prefill that stopped there, and the chunk's end state is unchanged."""
    cfg, m = model
    T = 150
    toks = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(5)).tolist()
    table = list(range(T // BS + 1))
    cuts = [64, 101, 149]
    a = new_cache(cfg, blocks=len(table) + 1)
    a.snap_state = torch.full((len(cfg.kda_layers), 3, *a.state.shape[2:]), float("nan"))
    a.snap_conv = torch.full((len(cfg.kda_layers), 3, *a.conv.shape[2:]), float("nan"))
    step = StepInput.build([(toks, 0, a.allocate_slot(), table)], BS, "cpu")
    step.kda_snapshots = {0: [(c, j) for j, c in enumerate(cuts)]}
    with torch.inference_mode():
        full = m(step, a)
    b = new_cache(cfg, blocks=len(table) + 1)
    nosnap = run(m, b, [(toks, 0, b.allocate_slot(), table)])
    assert rel_rmse(full, nosnap) < 1e-5 and rel_rmse(a.state[:, 0], b.state[:, 0]) < 1e-5
    for j, c in enumerate(cuts):
        r = new_cache(cfg, blocks=len(table) + 1)
        decode_all(m, r, toks[:c], r.allocate_slot(), table)  # the recurrent form, token by token
        assert rel_rmse(a.snap_state[:, j], r.state[:, 0]) < 1e-4, f"state snapshot after {c} tokens"
        assert rel_rmse(a.snap_conv[:, j], r.conv[:, 0]) < 1e-5, f"conv snapshot after {c} tokens"


@pytest.mark.gpu
def test_mla_prefill_through_the_flash_kernel_equals_the_pytorch_form(model):
    """The MLA layers' prefill through kernels/mla_prefill.py (the Triton interpreter on CPU), in chunks
    with a cached prefix: the same logits, states and cache entries as the PyTorch attention."""
    from peregrine import kernels
    from peregrine.models import mla as M
    if not kernels.available("cpu") and not torch.cuda.is_available():
        pytest.skip("triton kernels unavailable")
    cfg, m = model
    toks = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(8)).tolist()
    table = list(range(90 // BS + 1))
    res = []
    for on in (True, False):
        M.PREFILL_KERNEL = on
        try:
            c = new_cache(cfg, blocks=len(table) + 1)
            slot, pos, outs = c.allocate_slot(), 0, []
            for n in (37, 41, 12):
                outs.append(run(m, c, [(toks[pos:pos + n], pos, slot, table)]))
                pos += n
            res.append((torch.cat(outs), c.state.clone(), c.latent.clone()))
        finally:
            M.PREFILL_KERNEL = None
    (a, sa, la), (b, sb, lb) = res
    assert rel_rmse(a, b) < 1e-5 and rel_rmse(sa, sb) < 1e-5 and rel_rmse(la, lb) < 1e-5


@pytest.mark.gpu
def test_mla_core_keeps_the_flash_kernels_model_dtype_output_for_prefill_rows(monkeypatch):
    """BF16, the flash kernel on (the interpreter): prefill rows' attention lands in the core's output in the
    model dtype, bit-equal to the kernel's FP32 copy (no rounding added), and near the PyTorch attention; a step
    with a decode row keeps the FP32 output (the absorbed decode's)."""
    from peregrine import kernels
    from peregrine.models import mla as M
    if not kernels.available("cpu") and not torch.cuda.is_available():
        pytest.skip("triton kernels unavailable")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, _ = tiny()
    torch.manual_seed(0)
    with torch.device(dev):
        layer = M.MLA(cfg, cfg.mla_layers[0], torch.bfloat16)
    for p in layer.parameters():
        p.data = (torch.randn_like(p.float()) * 0.3).to(p.dtype)
    x = torch.randn(23, cfg.hidden_size, device=dev).to(torch.bfloat16)
    monkeypatch.setattr(M, "PREFILL_KERNEL", True)

    def core(seqs, rows):
        c = ModelCache(cfg, num_blocks=8, block_size=BS, num_slots=2, dtype=torch.bfloat16, device=dev)
        with torch.inference_mode():
            return layer.core(layer.project(x[:rows]), StepInput.build(seqs, BS, dev), c)
    row = (list(range(20)), 0, 0, list(range(5)))  # 20 tokens in 5 blocks of 4
    o = core([row], 20)
    with torch.inference_mode():
        q, lat = layer.project(x[:20])[0], layer.project(x[:20])[1]
        want = layer.prefill_attn(q, lat.to(torch.bfloat16), 0)  # the kernel's output copied to FP32
    assert o.dtype == torch.bfloat16 and torch.equal(o.float(), want.flatten(1))
    monkeypatch.setattr(M, "PREFILL_KERNEL", False)
    assert rel_rmse(o.float(), core([row], 20)) < 2e-2
    monkeypatch.setattr(M, "PREFILL_KERNEL", True)
    mixed = core([row, ([5], 3, 1, [5])], 21)
    assert mixed.dtype == torch.float32 and rel_rmse(mixed[:20], o.float()) < 1e-2


@pytest.mark.parametrize("short_max,launches", [(128, [16, 16, 5, 5]), (20, [5, 5])])
def test_short_prefill_rows_through_the_recurrence_kernel_equal_the_pytorch_form(model, monkeypatch, short_max, launches):
    """A mixed step (a decode row, a 37-token row that snapshots after 16 and 32 tokens, a 5-token row, all
    after cached prefixes) with the short prefill rows through kernels/kda.py's one-kernel recurrence (the
    interpreter; the GPU pass checks it at real widths, test_gpu_kda_prefill_paths_equal_the_pytorch_form):
    the same logits, states, conv windows and snapshots as the PyTorch forms. With rows of at most 20
    tokens short, the 37-token row is long: its head to the cut at 32 takes the chunked form and its
    5-token tail the kernel, from the state and conv window the head left."""
    from peregrine import kernels
    from peregrine.kernels import kda as KK
    from peregrine.models import kda as K
    if not kernels.available("cpu"):
        pytest.skip("runs under the Triton interpreter")
    cfg, m = model
    calls, real = [], KK.kda_decode
    monkeypatch.setattr(KK, "kda_decode", lambda qkv, *a, **k: calls.append(qkv.shape[1]) or real(qkv, *a, **k))
    monkeypatch.setattr(K, "SHORT_ROW_MAX_TOKENS", short_max)
    g = torch.Generator().manual_seed(21)
    toks = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 50, 14)]
    pre = (20, 13, 9)  # tokens of each sequence prefilled before the mixed step
    tables = [list(range(j * 16, j * 16 + 16)) for j in range(3)]
    res = []
    for on in (True, False):
        K.SHORT_ROWS_KERNEL = on
        try:
            c = new_cache(cfg, blocks=49)
            c.snap_state = torch.full((len(cfg.kda_layers), 2, *c.state.shape[2:]), float("nan"))
            c.snap_conv = torch.full((len(cfg.kda_layers), 2, *c.conv.shape[2:]), float("nan"))
            slots = [c.allocate_slot() for _ in range(3)]
            K.SHORT_ROWS_KERNEL = False  # the prefixes the same way in both runs
            run(m, c, [(t[:n], 0, s, tb) for t, n, s, tb in zip(toks, pre, slots, tables)])
            K.SHORT_ROWS_KERNEL = on
            step = StepInput.build([(t[n:], n, s, tb) for t, n, s, tb in zip(toks, pre, slots, tables)], BS, "cpu")
            step.kda_snapshots = {1: [(16, 0), (32, 1)]}
            with torch.inference_mode():
                out = m(step, c)
            res.append((out, c.state.clone(), c.conv.clone(), c.snap_state.clone(), c.snap_conv.clone(), c.latent.clone()))
        finally:
            K.SHORT_ROWS_KERNEL = None
    assert calls == launches * len(cfg.kda_layers)  # one launch per segment between cuts, then the 5-token row
    for name, a, b in zip(("logits", "state", "conv", "snapshot state", "snapshot conv", "latent"), *res):
        assert not a.isnan().any(), name
        assert rel_rmse(a, b) < 1e-5, name


def engine(prefix_caching: bool, preset="tiny-kimi-linear", **kw):
    kw = {"max_model_len": 512, **kw}
    ecfg = EngineConfig(device="cpu", dtype="fp32", max_num_seqs=2, block_size=16,
                        enable_prefix_caching=prefix_caching, cuda_graphs=False, **kw)
    ecfg.extra["lm_head_scale"] = LM_HEAD_SCALE
    eng, _ = build_engine(preset, ecfg, dummy_weights=True, log=lambda m: None)
    return eng


def greedy(eng, prompts, n=16):
    return eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))


# prompt tokens each case reuses: p (203 tokens, blocks of 16) leaves snapshots at its block-aligned
# chunk ends (budget 64: 64, 128, 192), at its last block ends (192, and 176 a block back) and where its
# decode passes a block end (208, on p + its own output); the changed token's recompute leaves one at its fork
# point (144, on p's blocks); p[:180] + 37 new reuses the one at 176
CASES = ("p", "p + 37 new", "p again", "p, token 150 changed", "p[:180] + 37 new", "p[:40]")
EXPECT = {64: [0, 192, 192, 128, 176, 0], 70: [0, 192, 192, 0, 176, 0]}


@pytest.mark.parametrize("budget", sorted(EXPECT))
def test_prefix_hit_equals_miss_on_the_model(budget):
    """Turn 2 (the prompt + new tokens: a hit that ends inside a block), a repeat, a one-token
    difference, a shorter prefix, with chunks that do (64) and do not (70) end on block ends (70: the
    snapshot at 192 is taken inside a chunk): the same greedy tokens as an engine caching nothing."""
    g = torch.Generator().manual_seed(11)
    p = torch.randint(0, 320, (203,), generator=g).tolist()
    more = torch.randint(0, 320, (37,), generator=g).tolist()
    flip = list(p)
    flip[150] = (flip[150] + 1) % 320
    prompts = [p, p + more, p, flip, p[:180] + more, p[:40]]
    hit = engine(True, max_num_batched_tokens=budget)
    miss = engine(False, max_num_batched_tokens=budget)
    reused = []
    for name, q in zip(CASES, prompts):
        before = hit.prefix_cache.stats["hit_tokens"]
        assert greedy(hit, [q]) == greedy(miss, [q]), name
        reused.append(hit.prefix_cache.stats["hit_tokens"] - before)
    assert reused == EXPECT[budget]
    assert miss.prefix_cache.stats["hit_tokens"] == 0


def torch_fla_ops(K):
    """fla's three prefill ops (the call signatures models/kda.py uses) written with the torch forms of
    models/kda.py: so the fla paths' bookkeeping (windows, states, snapshots, varlen rows) runs on the CPU."""
    from types import SimpleNamespace

    def causal_conv1d(x, weight, activation, initial_state):
        ext = torch.cat([initial_state[0, :, 1:].T, x[0]])[None]  # window slot j holds input j - W
        return K.causal_conv(ext, weight).to(x.dtype), None

    def chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, A_log, dt_bias, cu_seqlens=None, use_graph=False,
                  safe_gate=False, lower_bound=None):
        H = q.shape[2]
        cu = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outs, ends = [], []
        for j, (a, e) in enumerate(zip(cu, cu[1:])):
            gg = K.kda_gate(g[:, a:e].flatten(-2), A_log, dt_bias, H, lower_bound)
            nrm = K.l2norm if use_qk_l2norm_in_kernel else (lambda z: z)  # noqa: E731  normed by the caller
            o, S = K.chunk_kda(nrm(q[:, a:e].float()) * scale, nrm(k[:, a:e].float()), v[:, a:e], gg,
                               torch.sigmoid(beta[:, a:e].float()), S0=initial_state[j:j + 1])
            outs.append(o.to(q.dtype)), ends.append(S[0])
        return torch.cat(outs, 1), torch.stack(ends)

    def rms_norm_gated(x, g, weight, bias, activation, eps):
        from peregrine.models.layers import rms_norm
        return (rms_norm(x, weight, eps).float() * torch.sigmoid(g.float())).to(x.dtype)

    return SimpleNamespace(causal_conv1d=causal_conv1d, chunk_kda=chunk_kda, rms_norm_gated=rms_norm_gated)


def fla_path_layer(monkeypatch, conv_kernel: bool, lower_bound, slots: int):
    """(models.kda, config, the tiny model's first KDA layer with the given gate, a cache with two snapshots)
    for the fla paths' CPU tests; conv_kernel picks the fused short conv or fla's form."""
    from peregrine.models import kda as K
    monkeypatch.setattr(K, "CONV_KERNEL", conv_kernel)
    cfg, m = tiny()
    layer = m.layers[cfg.kda_layers[0]].attn
    layer.cfg = dataclasses.replace(cfg, kda_gate_lower_bound=lower_bound)  # bounded: K3's gate
    c = new_cache(cfg, slots=slots)
    c.snap_state = torch.zeros(c.state.shape[0], 2, *c.state.shape[2:])
    c.snap_conv = torch.zeros(c.conv.shape[0], 2, *c.conv.shape[2:])
    return K, cfg, layer, c


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("conv_kernel", [True, False], ids=["conv-kernel", "fla-conv"])
def test_kda_rows_sharing_one_fla_call_keep_each_rows_state_window_and_snapshot(conv_kernel, lower_bound, monkeypatch):
    """KDA.prefill_fla_rows (the GPU's varlen call for several rows' heads) through torch_fla_ops: each
    row's output, state, conv window and snapshot equal the recurrent form's run row by row written here,
    and rows of the step it does not own (between and after them) are untouched. Both short convs: the
    fused kernel (under the interpreter; its q, k arrive L2-normalised) and the fla form."""
    K, cfg, layer, c = fla_path_layer(monkeypatch, conv_kernel, lower_bound, slots=4)
    kl = c.kda_index[layer.layer]
    g = torch.Generator().manual_seed(9)
    c.state[kl].normal_(generator=g).mul_(0.1)
    c.conv[kl].normal_(generator=g)
    N, W1 = 60, cfg.kda_conv_size - 1
    qkv, f, b, r = layer.project(torch.randn(N, cfg.hidden_size, generator=g))
    heads = [(0, 23, 2, 1), (30, 57, 0, 0)]  # (a, m, slot, snapshot): rows 23..29 and 57.. not theirs
    want_state, want_conv = c.state[kl].clone(), c.conv[kl].clone()
    want_out = torch.full((N, r.shape[1]), float("nan"))
    want_snap = {}
    for a, e, s, snap in heads:
        ext = torch.cat([c.conv[kl, s:s + 1], qkv[None, a:e]], 1)
        S = c.state[kl, s:s + 1].clone()
        o = layer.mix(K.causal_conv(ext, layer.conv_w), f[None, a:e], b[None, a:e], S)
        want_out[a:e] = layer.gate_norm(o[0], r[a:e], qkv.dtype)
        want_state[s], want_conv[s] = S[0], ext[0, -W1:]
        if snap is not None:
            want_snap[snap] = (S[0], ext[0, -W1:])
    out = torch.full((N, r.shape[1]), float("nan"))
    with torch.inference_mode():
        layer.prefill_fla_rows(torch_fla_ops(K), [(a, e, torch.tensor([s]), sn) for a, e, s, sn in heads],
                               qkv, f, b, r, c.state[kl], c.conv[kl], c, kl, out)
    assert out[23:30].isnan().all() and out[57:].isnan().all()
    assert rel_rmse(out[:23], want_out[:23]) < 1e-5 and rel_rmse(out[30:57], want_out[30:57]) < 1e-5
    assert rel_rmse(c.state[kl], want_state) < 1e-5 and torch.equal(c.conv[kl], want_conv)  # slots 1, 3 too
    for snap, (S, w) in want_snap.items():
        assert rel_rmse(c.snap_state[kl, snap], S) < 1e-5 and torch.equal(c.snap_conv[kl, snap], w)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("conv_kernel", [True, False], ids=["conv-kernel", "fla-conv"])
def test_one_kda_row_through_fla_with_cuts_keeps_its_state_window_and_snapshots(conv_kernel, lower_bound, monkeypatch):
    """KDA.prefill_fla (one row, an fla call per segment between snapshot cuts) through torch_fla_ops:
    its W_o input (written piece by piece into its rows of the step's), final state, conv window and each
    cut's snapshot equal the recurrent form's (both short convs; the output norm through the gated-norm kernel)."""
    K, cfg, layer, c = fla_path_layer(monkeypatch, conv_kernel, lower_bound, slots=2)
    kl, W1 = c.kda_index[layer.layer], cfg.kda_conv_size - 1
    g = torch.Generator().manual_seed(10)
    S0, w0 = torch.randn(c.state.shape[2:], generator=g) * 0.1, torch.randn(c.conv.shape[2:], generator=g)
    qkv, f, b, r = layer.project(torch.randn(41, cfg.hidden_size, generator=g))
    ext = torch.cat([w0[None], qkv[None]], 1)
    y, S, want, snaps = K.causal_conv(ext, layer.conv_w), S0[None].clone(), [], {}
    for lo, hi, snap in ((0, 9, 0), (9, 30, 1), (30, 41, None)):
        want.append(layer.mix(y[:, lo:hi], f[None, lo:hi], b[None, lo:hi], S))
        if snap is not None:
            snaps[snap] = (S[0].clone(), ext[0, hi:hi + W1])
    want = layer.gate_norm(torch.cat(want, 1)[0], r, qkv.dtype)
    buf = torch.full((45, r.shape[1]), float("nan"))  # the row's W_o input lands in rows 2..42 only
    with torch.inference_mode():
        S1 = S0[None].clone()
        win = layer.prefill_fla(torch_fla_ops(K), qkv, f, b, r, S1, w0, [(9, 0), (30, 1), (41, None)], c, kl, buf[2:43])
    assert buf[:2].isnan().all() and buf[43:].isnan().all()
    assert rel_rmse(buf[2:43], want) < 1e-5 and rel_rmse(S1, S) < 1e-5 and torch.equal(win, ext[0, -W1:])
    for snap, (Ss, w) in snaps.items():
        assert rel_rmse(c.snap_state[kl, snap], Ss) < 1e-5 and torch.equal(c.snap_conv[kl, snap], w)


# ---- on the GPU: the fast prefill kernels against the PyTorch forms ----
cuda = pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                          reason="needs a CUDA GPU")


def kda_layer(preset: str):
    """(config, the preset's first KDA layer on the GPU in BF16 with random weights at useful scales)."""
    from peregrine.config import resolve_model
    from peregrine.models import kda as K
    cfg, _ = resolve_model(preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = K.KDA(cfg, cfg.kda_layers[0], torch.bfloat16)
    for name, p in layer.named_parameters():
        p.data = (torch.randn_like(p.float()) * (0.5 if name in ("A_log", "dt_bias", "o_norm", "conv_w") else 0.02)).to(p.dtype)
    layer.o_norm.data += 1
    return cfg, layer


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T,cuts", [(333, (100, 257)), (100, (40, 64))])
@pytest.mark.parametrize("preset", ["kimi-linear-48b-a3b", "k3-slice"])
@pytest.mark.parametrize("tail_min", [8192, 300], ids=["tail-kernel", "tail-fla"])
def test_gpu_kda_prefill_paths_equal_the_pytorch_form(preset, T, cuts, tail_min, monkeypatch):
    """A KDA layer at real widths (softplus gate and low-rank output gate; K3: bounded gate, full-rank
    output gate) prefilling after a non-zero state, with two snapshots on the way, against the PyTorch
    forms: 333 tokens through fla's kernels (conv, fused gates and norms, chunk_kda, gated RMSNorm) to the
    last cut and the one-kernel recurrence after it, 100 (<= SHORT_ROW_MAX_TOKENS) through the one-kernel
    recurrence, one launch per segment. With FLA_TAIL_MIN_TOKENS at 300 the long row's tail runs through fla
    too (a second call after the cut). fla's q, k, v come from the fused short conv (kernels/kda_conv.py)."""
    from peregrine.kernels import kda as KK
    from peregrine.models import kda as K
    monkeypatch.setattr(K, "FLA_TAIL_MIN_TOKENS", tail_min)
    assert K.CONV_KERNEL
    calls, real = [], KK.kda_decode
    monkeypatch.setattr(KK, "kda_decode", lambda qkv, *a, **k: calls.append(qkv.shape[1]) or real(qkv, *a, **k))
    if K.fla_ops() is None:
        pytest.skip("fla-core is not installed")
    cfg, layer = kda_layer(preset)
    x = torch.randn(T, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    res = []
    for fast in (True, False):
        K._FLA, K.SHORT_ROWS_KERNEL = (None, None) if fast else (False, False)
        c = ModelCache(cfg, num_blocks=2, block_size=64, num_slots=2, dtype=torch.bfloat16, device="cuda", num_snapshots=2)
        kl = c.kda_index[layer.layer]
        g = torch.Generator(device="cuda").manual_seed(1)
        c.state[kl, 0] = torch.randn(c.state.shape[2:], device="cuda", generator=g) * 0.05
        c.conv[kl, 0] = torch.randn(c.conv.shape[2:], device="cuda", generator=g).to(c.conv.dtype)
        step = StepInput.build([(list(range(T)), 64, 0, [0] * 7)], 64, "cuda")
        step.kda_snapshots = {0: [(cuts[0], 0), (cuts[1], 1)]}
        with torch.inference_mode():
            out = layer(x, step, c)
        res.append((out.float(), c.state[kl, 0].clone(), c.conv[kl, 0].clone(), c.snap_state[kl].clone(),
                     c.snap_conv[kl].clone()))
    K._FLA, K.SHORT_ROWS_KERNEL = None, None
    short = T <= K.SHORT_ROW_MAX_TOKENS
    # a long row's tail after its last cut (76 tokens) takes the kernel too, unless the row is FLA_TAIL_MIN_TOKENS long
    assert calls == ([cuts[0], cuts[1] - cuts[0], T - cuts[1]] if short else [T - cuts[1]] if T < tail_min else [])
    (o1, s1, c1, ss1, sc1), (o2, s2, c2, ss2, sc2) = res
    assert rel_rmse(o1, o2) < 2e-2 and rel_rmse(s1, s2) < 2e-2 and rel_rmse(ss1, ss2) < 2e-2
    assert torch.equal(c1, c2) and torch.equal(sc1, sc2)  # conv windows are copies of inputs


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("preset,bounded_shared", [("kimi-linear-48b-a3b", False), ("k3-slice", False), ("k3-slice", True)],
                         ids=["48b", "k3-per-row", "k3-shared"])
def test_gpu_kda_rows_of_one_step_share_a_varlen_fla_call(preset, bounded_shared, monkeypatch):
    """Five rows in one step at real widths, each after its own non-zero state: two long rows whose fla
    heads end at one cut (a snapshot before a tail, and a whole row) share one varlen chunk_kda call; a row
    with two cuts in its head and a short row keep their own paths; a decode row rides along. Outputs,
    states, conv windows and snapshots equal the PyTorch forms, and the rows' fla calls are counted."""
    from peregrine.models import kda as K
    if K.fla_ops() is None:
        pytest.skip("fla-core is not installed")
    monkeypatch.setattr(K, "VARLEN_BOUNDED_GATE", bounded_shared)  # k3-shared: the case that decides enabling it
    ops = K.fla_ops()
    calls, real = [], ops.chunk_kda
    monkeypatch.setattr(ops, "chunk_kda", lambda q, *a, **k: calls.append(
        (q.shape[1], None if k.get("cu_seqlens") is None else k["cu_seqlens"].tolist())) or real(q, *a, **k))
    cfg, layer = kda_layer(preset)
    lens, starts = [333, 1, 500, 300, 90], [0, 40, 64, 0, 128]  # row 2 and 4 after a cached prefix
    snaps = {0: [(257, 0)], 3: [(100, 1), (200, 2)]}
    x = torch.randn(sum(lens), cfg.hidden_size, device="cuda").to(torch.bfloat16)
    res = []
    for fast in (True, False):
        K._FLA, K.SHORT_ROWS_KERNEL = (ops, None) if fast else (False, False)  # ops: the counted namespace
        c = ModelCache(cfg, num_blocks=64, block_size=64, num_slots=5, dtype=torch.bfloat16, device="cuda", num_snapshots=3)
        kl = c.kda_index[layer.layer]
        g = torch.Generator(device="cuda").manual_seed(1)
        c.state[kl] = torch.randn(c.state.shape[1:], device="cuda", generator=g) * 0.05
        c.conv[kl] = torch.randn(c.conv.shape[1:], device="cuda", generator=g).to(c.conv.dtype)
        seqs = [(list(range(n)), st, j, list(range(12 * j, 12 * j + 12))) for j, (n, st) in enumerate(zip(lens, starts))]
        step = StepInput.build(seqs, 64, "cuda")
        step.kda_snapshots = snaps
        with torch.inference_mode():
            out = layer(x, step, c)
        res.append((out.float(), c.state[kl].clone(), c.conv[kl].clone(), c.snap_state[kl].clone(), c.snap_conv[kl].clone()))
    K._FLA, K.SHORT_ROWS_KERNEL = None, None
    # one varlen call for rows 0 (head 257) and 2 (500), then row 3's two segments on its own (K3's bounded
    # gate: one call per row unless VARLEN_BOUNDED_GATE)
    if cfg.kda_gate_lower_bound is None or bounded_shared:
        assert calls == [(757, [0, 257, 757]), (100, None), (100, None)], calls
    else:
        assert calls == [(257, None), (500, None), (100, None), (100, None)], calls
    (o1, s1, c1, ss1, sc1), (o2, s2, c2, ss2, sc2) = res
    assert rel_rmse(o1, o2) < 2e-2 and rel_rmse(s1, s2) < 2e-2 and rel_rmse(ss1, ss2) < 2e-2
    for j in range(5):  # every row's own state
        assert rel_rmse(s1[j], s2[j]) < 2e-2, j
    assert torch.equal(c1, c2) and torch.equal(sc1, sc2)  # conv windows are copies of inputs


@cuda
@pytest.mark.gpu
def test_gpu_prefill_kernels_equal_the_pytorch_forms():
    """The standard path's chunked prefill on the GPU with the flash MLA kernel and fla (when present)
    against the same model with both switched off: last-token logits and every KDA state (BF16)."""
    from peregrine.models import kda as K, mla as M
    cfg, m = tiny()
    m = m.cuda().to(torch.bfloat16)
    toks = torch.randint(0, cfg.vocab_size, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(700 // BS + 1))

    def prefill(fast: bool):
        c = ModelCache(cfg, num_blocks=len(table) + 1, block_size=BS, num_slots=2, dtype=torch.bfloat16, device="cuda")
        M.PREFILL_KERNEL, K._FLA, K.SHORT_ROWS_KERNEL = (None, None, None) if fast else (False, False, False)
        try:
            slot, pos, out = c.allocate_slot(), 0, None
            for n in (300, 257, 143):  # chunks with a prefix: the kernel's start > 0 case
                with torch.inference_mode():
                    out = m(StepInput.build([(toks[pos:pos + n], pos, slot, table)], BS, "cuda"), c)
                pos += n
            return out.float(), c.state.clone()
        finally:
            M.PREFILL_KERNEL, K._FLA, K.SHORT_ROWS_KERNEL = None, None, None

    fast, slow = prefill(True), prefill(False)
    assert rel_rmse(fast[0], slow[0]) < 3e-2 and rel_rmse(fast[1], slow[1]) < 3e-2


@cuda
@pytest.mark.gpu
def test_gpu_a_prefill_forward_never_makes_the_host_wait():
    """A cold prefill step (one 700-token row through the fast kernels, as a cold prompt's) runs from its
    first layer to its logits without one host sync (torch's sync debug mode raises on any): the host runs
    ahead of the GPU, so the engine's bookkeeping after a forward overlaps its last layers."""
    cfg, m = tiny()
    m = m.cuda().to(torch.bfloat16)
    toks = torch.randint(0, cfg.vocab_size, (700,), generator=torch.Generator().manual_seed(13)).tolist()
    table = list(range(700 // BS + 1))
    c = ModelCache(cfg, num_blocks=len(table) + 1, block_size=BS, num_slots=2, dtype=torch.bfloat16, device="cuda")
    rows = [(toks, 0, c.allocate_slot(), table)]
    with torch.inference_mode():
        m(StepInput.build(rows, BS, "cuda"), c)  # compiles and autotunes outside the check
        torch.cuda.synchronize()
        step = StepInput.build(rows, BS, "cuda", non_blocking=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = m(step, c)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (1, cfg.vocab_size) and out.isfinite().all()


def test_prompt_logprobs_compute_the_whole_prompt_even_when_cached():
    """echo / loglikelihood requests need every prompt position's logits: a cached prefix is not
    reused for them, so each prompt token gets its logprob, the same as without a cache."""
    g = torch.Generator().manual_seed(12)
    p = torch.randint(0, 320, (150,), generator=g).tolist()
    outs = []
    for cache_on in (True, False):
        eng = engine(cache_on, max_num_batched_tokens=64)
        greedy(eng, [p])  # leaves p's blocks and snapshots in the cache
        got = []
        eng.add_request(p, SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True),
                        on_token=lambda o: got.append(o.prompt_logprobs) if o.prompt_logprobs else None)
        while eng.has_unfinished():
            eng.step()
        outs.append([None if t is None else t.logprob for t in got[0]])
        assert eng.prefix_cache.stats["hit_tokens"] == 0
    assert outs[0][0] is None and all(x is not None for x in outs[0][1:])
    assert torch.allclose(torch.tensor(outs[0][1:]), torch.tensor(outs[1][1:]), atol=1e-4)


@pytest.mark.parametrize("preset,kw", [("tiny-k3", {}), ("tiny-kimi-linear", {"kv_cache_dtype": "fp8"}),
                                       ("tiny-kimi-linear", {"speculative_config": {"method": "ngram",
                                                                                    "num_speculative_tokens": 3}})])
def test_prefix_hit_equals_miss_k3_fp8_and_speculative(preset, kw):
    """K3 layers (bounded gate, q-LoRA MLA, AttnRes), an FP8 latent cache (the shared blocks hold FP8
    entries) and speculative decoding on top of prefix hits: the same greedy tokens as without reuse."""
    from peregrine.speculative.config import SpeculativeConfig
    if "speculative_config" in kw:
        kw = {**kw, "speculative_config": SpeculativeConfig.parse(kw["speculative_config"])}
    g = torch.Generator().manual_seed(13)
    p = torch.randint(0, 320, (150,), generator=g).tolist()
    prompts = [p, p + torch.randint(0, 320, (20,), generator=g).tolist(), p]
    hit = engine(True, preset, max_num_batched_tokens=64, **kw)
    miss = engine(False, preset, max_num_batched_tokens=64, **kw)
    for q in prompts:
        assert greedy(hit, [q]) == greedy(miss, [q])
    assert hit.prefix_cache.stats["hit_tokens"] == 2 * 144
