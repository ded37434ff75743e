"""Tensor parallel on CPU (gloo): shards are exact slices of the one-rank weights,
TP = N logits equal TP = 1 (prefill and decode steps) and greedy tokens are identical,
every rank holds only its slice, the vocab-parallel argmax picks the lowest index of
the global max (ties inside and across ranks), and sizes that do not divide fail
naming the config field. The engine tests make the pytest process rank 0 and spawn
the other ranks, exactly as `--tensor-parallel-size N` does."""
import json
import os

import pytest
import torch

from conftest import write_dummy_model
from peregrine.config import PRESET_DIR, ConfigError, EngineConfig, ModelConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.models.kimi import KimiModel
from peregrine.models.loader import init_dummy_weights
from peregrine.parallel import launch
from peregrine.parallel.group import TPGroup
from peregrine.parallel.shard import describe, holdings
from peregrine.parallel.slicing import shard_config, slice_of, slicing, take
from peregrine.testing import rel_rmse

TOL = 1e-5  # FP32 on CPU: only the order of the partial sums differs
K3_OVER = {"moe_intermediate_size": 64}  # tiny-k3's 32 rows of MXFP4 experts cannot split into 32-wide groups
TP8_OVER = {"num_attention_heads": 8, "num_key_value_heads": 8,  # tiny-kimi-linear with 8 KDA and 8 MLA heads
            "linear_attn_config": {"full_attn_layers": [3, 5], "kda_layers": [1, 2, 4], "head_dim": 32, "num_heads": 8,
                                   "short_conv_kernel_size": 4}}
SLICED = {"tp_slice_replicated": True}


def raw_config(preset: str, **over) -> dict:
    raw = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    (raw.get("text_config") or raw).update(over)
    return raw


def model_dir(tmp_path, raw: dict, weights_seed: int | None = None) -> str:
    return write_dummy_model(tmp_path, raw, weights_seed)


@pytest.fixture(autouse=True, scope="module")
def _leave_group():
    yield
    launch.shutdown()


# ---- shards (in process, no group needed) ----
# (preset, overrides, world, slicing: the replicated projections it splits)
SHARD_CASES = [("tiny-kimi-linear", {}, 2, None), ("tiny-kimi-linear", {}, 4, None), ("tiny-k3", K3_OVER, 2, None),
               ("tiny-kimi-linear", TP8_OVER, 8, None),
               ("tiny-kimi-linear", {}, 4, {"gate", "kv_a_proj_with_mqa"}),
               ("tiny-k3", K3_OVER, 2, {"gate", "kv_a_proj_with_mqa", "q_a_proj"}),
               ("tiny-kimi-linear", TP8_OVER, 8, {"gate", "kv_a_proj_with_mqa"}),
               ("tiny-kimi-linear", {**TP8_OVER, "num_experts": 12}, 8, {"kv_a_proj_with_mqa"})]  # 12 experts: router whole


@pytest.mark.parametrize("preset,over,world,sliced", SHARD_CASES)
def test_shards_are_exact_slices_of_the_full_weights(preset, over, world, sliced):
    cfg = ModelConfig.from_dict(raw_config(preset, **over))
    full = KimiModel(cfg)
    init_dummy_weights(full, seed=5)
    ref = {n: v for n, v, _ in full.hf_params()}
    split_seen = set()
    total = 0
    for r in range(world):
        tp = TPGroup(r, world, slice_replicated=sliced is not None)
        m = KimiModel(cfg, tp=tp)
        for p in m.parameters():
            p.data.fill_(float("nan")) if p.is_floating_point() else p.data.fill_(0)  # poison: every slice must be written
        init_dummy_weights(m, seed=5)
        for name, view, _ in m.hf_params():
            sl = slice_of(name, tuple(ref[name].shape), tuple(view.shape), tp)
            assert torch.equal(take(ref[name], sl, view.shape), view), f"rank {r}: {name} is not its slice"
            if sl is not None:
                split_seen.add(name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1])
        total += sum(p.numel() for p in m.parameters())
    # the split tensors: heads, intermediate rows, vocab; the rest is replicated
    for part in ("q_proj", "b_proj", "o_proj", "kv_b_proj", "down_proj", "embed_tokens", "lm_head"):
        assert part in split_seen, f"{part} was not split"
    assert "f_a_proj" not in split_seen  # KDA's low-rank projections stay whole, slicing or not
    for part in ("gate", "kv_a_proj_with_mqa", "q_a_proj"):
        assert (part in split_seen) == (part in (sliced or ())), f"{part}: split {part in split_seen}"
    assert total < world * sum(p.numel() for p in full.parameters())


def test_slicing_says_what_stays_replicated():
    cfg = ModelConfig.from_dict(raw_config("tiny-kimi-linear", **TP8_OVER, num_experts=12))
    assert slicing(cfg, TPGroup(0, 8)) == {}  # off: nothing sliced
    got = slicing(cfg, TPGroup(3, 8, slice_replicated=True))
    assert got["kv_a"] is None and "q_a" not in got  # no q-LoRA: nothing to say about q_a
    assert "'num_experts' (12) is not divisible by 8" in got["router"]
    h = holdings(KimiModel(cfg, tp=TPGroup(3, 8, slice_replicated=True)))
    assert h["sliced"] == {"router": got["router"], "kv_a": "sliced"} and "router 'num_experts'" in describe(h)
    with pytest.raises(ConfigError, match="tp_slice_replicated must be true or false"):
        EngineConfig().apply_additional_config('{"tp_slice_replicated": 1}')
    e = EngineConfig()
    e.apply_additional_config('{"tp_slice_replicated": true}')
    assert e.tp_slice_replicated is True and EngineConfig().tp_slice_replicated is False


def test_sizes_that_do_not_divide_name_the_field(tmp_path):
    cfg = ModelConfig.from_dict(raw_config("tiny-kimi-linear"))
    with pytest.raises(ConfigError, match="linear_attn_config.num_heads"):
        shard_config(cfg, TPGroup(0, 3))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        shard_config(ModelConfig.from_dict(raw_config("tiny-kimi-linear", num_attention_heads=6)), TPGroup(0, 4))
    with pytest.raises(ConfigError, match="vocab_size"):
        shard_config(ModelConfig.from_dict(raw_config("tiny-kimi-linear", vocab_size=322)), TPGroup(0, 4))
    with pytest.raises(ConfigError, match="MXFP4"):
        shard_config(ModelConfig.from_dict(raw_config("tiny-k3")), TPGroup(0, 2))
    # the engine refuses before launching any process
    with pytest.raises(ConfigError, match="linear_attn_config.num_heads"):
        build_engine("tiny-kimi-linear", EngineConfig(tensor_parallel_size=3, device="cpu"), dummy_weights=True,
                     log=lambda m: None)
    assert launch._state["tp"] is None


# ---- engine runs: pytest is rank 0, the other ranks are spawned ----
PROMPTS = [[5, 17, 3, 250, 9, 61, 7], [1, 2], [44]]
STEPS = 6


def run(model, tp, backend="standard", dummy=True, **kw):
    ecfg = EngineConfig(max_num_seqs=4, max_model_len=64, block_size=8, device="cpu", decode_backend=backend,
                        tensor_parallel_size=tp, **kw)
    e, _ = build_engine(model, ecfg, dummy_weights=dummy, log=lambda m: None)
    rec, fwd = [], e.runner.forward

    def recording(step):
        out = fwd(step)
        rec.append((step.is_decode, e.runner.last_path, out.clone()))
        return out
    e.runner.forward = recording
    toks = e.generate(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return toks, rec, e


def assert_same(a, b):
    toks_a, rec_a, _ = a
    toks_b, rec_b, _ = b
    assert len(rec_a) == len(rec_b)
    assert any(not d for d, _, _ in rec_a) and any(d for d, _, _ in rec_a), "needs prefill and decode steps"
    for i, ((dec, _, la), (_, _, lb)) in enumerate(zip(rec_a, rec_b)):
        assert la.shape == lb.shape
        assert rel_rmse(lb, la) < TOL, f"step {i} ({'decode' if dec else 'prefill'}) logits differ"
    assert toks_a == toks_b


def check_tp_equals_one_rank_dummy_weights(world):
    one = run("tiny-kimi-linear", 1)
    many = run("tiny-kimi-linear", world)
    assert_same(one, many)
    held = many[2].tp_holdings
    assert [h["rank"] for h in held] == list(range(world))
    cfg = ModelConfig.from_dict(raw_config("tiny-kimi-linear"))
    for r, h in enumerate(held):  # each rank holds exactly its shard, nothing more
        assert h["params"] == sum(p.numel() for p in KimiModel(cfg, tp=TPGroup(r, world)).parameters())
        assert h["vocab_rows"] == f"{r * 320 // world}-{(r + 1) * 320 // world - 1} of 320"


def test_tp2_equals_one_rank_dummy_weights():
    check_tp_equals_one_rank_dummy_weights(2)


def test_tp2_prefix_cache_hits_equal_one_rank_without_it():
    """Prefix caching under TP: every rank takes the same KDA snapshots (in-chunk and after steps) and
    loads them on a hit, so turn 2 and a repeat give one rank's no-cache tokens."""
    g = torch.Generator().manual_seed(3)
    p = torch.randint(0, 320, (45,), generator=g).tolist()
    turns = [p, p + [7, 8, 9], p]
    outs = {}
    for tp, cache in ((1, False), (2, True)):
        ecfg = EngineConfig(max_num_seqs=2, max_model_len=96, block_size=8, device="cpu", tensor_parallel_size=tp,
                            max_num_batched_tokens=12, enable_prefix_caching=cache)
        e, _ = build_engine("tiny-kimi-linear", ecfg, dummy_weights=True, log=lambda m: None)
        outs[tp] = [e.generate([t], SamplingParams(max_tokens=6, ignore_eos=True))[0] for t in turns]
        hit = e.prefix_cache.stats["hit_tokens"]
    assert outs[1] == outs[2]
    assert hit == 40 + 40  # turn 2 and the repeat reuse up to the snapshot at 40 (taken inside a 12-token chunk)


def test_tp2_loads_slices_from_a_checkpoint_and_k3(tmp_path):
    """Weights read from safetensors (each rank reads only its slices), on a K3 shard (latent MoE,
    MXFP4 experts, q-LoRA MLA, AttnRes) and on the Kimi-Linear tiny model."""
    for sub, preset, over in (("kl", "tiny-kimi-linear", {}), ("k3", "tiny-k3", K3_OVER)):
        (tmp_path / sub).mkdir()
        d = model_dir(tmp_path / sub, raw_config(preset, **over), weights_seed=3)
        one = run(d, 1, dummy=False)
        two = run(d, 2, dummy=False)
        assert_same(one, two)


def test_tp2_sliced_router_and_latent_equal_one_rank(tmp_path):
    """tp_slice_replicated: router logits and MLA kv_a (K3: and q_a) computed as a slice per rank and
    gathered, on the standard path: Kimi-Linear (dummy weights) and a K3 checkpoint (q-LoRA MLA)."""
    one = run("tiny-kimi-linear", 1)
    two = run("tiny-kimi-linear", 2, **SLICED)
    assert_same(one, two)
    assert two[2].tp_holdings[1]["sliced"] == {"router": "sliced", "kv_a": "sliced"}
    d = model_dir(tmp_path, raw_config("tiny-k3", **K3_OVER), weights_seed=3)
    one = run(d, 1, dummy=False)
    two = run(d, 2, dummy=False, **SLICED)
    assert_same(one, two)
    assert two[2].tp_holdings[0]["sliced"] == {"router": "sliced", "kv_a": "sliced", "q_a": "sliced"}


def micro_dir(heads: int) -> str:
    """test_specialized's micro config with `heads` KDA and MLA heads, dummy weights saved."""
    from test_specialized import MICRO
    import tempfile
    from pathlib import Path
    raw = raw_config("tiny-kimi-linear", **MICRO)
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "num_heads": heads}
    raw["num_attention_heads"] = raw["num_key_value_heads"] = heads
    return model_dir(Path(tempfile.mkdtemp()), raw, weights_seed=4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run the kernels under the interpreter")
def test_tp2_specialized_path():
    """latency_specialized with TP = 2 (kernels under the interpreter on a micro config), replicated
    and sliced router / MLA latent."""
    check_specialized_tp2_equals_one_rank(micro_dir(2))


def check_specialized_tp2_equals_one_rank(d: str):
    """Specialized TP = 2, replicated and sliced, against one rank's standard path: every decode step
    served by the fused kernels (none falls back as unsupported), decode lookahead running under TP."""
    one = run(d, 1, dummy=False)
    for kw in ({}, SLICED):
        two = run(d, 2, backend="latency_specialized", dummy=False, **kw)
        assert any(p == "latency_specialized" for _, p, _ in two[1]), "no step took the specialized path"
        assert not any("unsupported" in r for r in two[2].stats["fallback_reasons"])
        assert two[2].stats["lookahead_steps"] > 0, "decode lookahead never ran under TP"  # ids: each rank's argmax
        assert_same(one, two)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run the kernels under the interpreter")
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "bf16"])
def test_tp2_specialized_path_k3(tmp_path, mxfp4):
    """K3 layers (bounded-gate KDA, q-LoRA MLA with output gate, latent MoE reduced before its norm,
    AttnRes) on the specialized path at TP = 2, replicated and sliced, against one rank's standard path."""
    from test_k3_specialized import k3_raw
    raw = k3_raw(mxfp4)
    raw["text_config"]["moe_intermediate_size"] = 64  # MXFP4: each rank's 32 rows stay whole scale groups
    check_specialized_tp2_equals_one_rank(model_dir(tmp_path, raw, weights_seed=4))


def test_tp4_equals_one_rank_dummy_weights():
    """The two-rank group is replaced by a four-rank one."""
    check_tp_equals_one_rank_dummy_weights(4)


def test_tp4_sliced_equals_one_rank():
    """Sliced router / MLA latent at TP = 4, standard path (tiny preset)."""
    assert_same(run("tiny-kimi-linear", 1), run("tiny-kimi-linear", 4, **SLICED))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run the kernels under the interpreter")
def test_tp4_sliced_specialized_path():
    """Sliced router / MLA latent at TP = 4 on the specialized path (micro config, 4 heads; ~50 s on 2 CPUs)."""
    d = micro_dir(4)
    four = run(d, 4, backend="latency_specialized", dummy=False, **SLICED)
    assert any(p == "latency_specialized" for _, p, _ in four[1]), "no step took the specialized path"
    assert_same(run(d, 1, dummy=False), four)


@pytest.mark.slow
def test_tp8_equals_one_rank_replicated_and_sliced(tmp_path):
    """Last of the engine tests: eight ranks on the tiny preset with 8 heads (~25 s on 2 CPUs)."""
    d = model_dir(tmp_path, raw_config("tiny-kimi-linear", **TP8_OVER))
    one = run(d, 1)
    for kw in ({}, SLICED):
        eight = run(d, 8, **kw)
        assert_same(one, eight)
        assert [h["rank"] for h in eight[2].tp_holdings] == list(range(8))
    launch.shutdown()


# ---- collectives over a real gloo group ----
def _collectives(rank, world, port, q):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = TPGroup(rank, world, torch.device("cpu"))
    V = 5  # vocab rows per rank
    full = torch.tensor([[0., 1., 9., 3., 9.] + [9., 2., 0., 9., 1.] + [4.] * 5 * (world - 2),   # tie across ranks
                         [1., 1., 1., 1., 1.] + [1.] * 5 * (world - 1),                         # all equal
                         [-3., -2., -1., -5., -4.] + [-2., -1., -0.5, -7., -0.5] + [-9.] * 5 * (world - 2)])
    local = full[:, rank * V:(rank + 1) * V].clone()
    got = tp.argmax(local)
    gathered = tp.all_gather(local, -1)
    stacked_ok = torch.equal(tp.all_gather_stacked(local), torch.stack(full.split(V, -1)))
    x = torch.full((2, 3), float(rank + 1))
    red = tp.all_reduce(x.clone())
    q.put((rank, got.tolist(), full.argmax(-1).tolist(), torch.equal(gathered, full) and stacked_ok, red[0, 0].item()))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gathered_argmax_ties_gather_and_reduce(world):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = launch._free_port()
    ps = [ctx.Process(target=_collectives, args=(r, world, port, q)) for r in range(world)]
    for p in ps:
        p.start()
    res = [q.get(timeout=120) for _ in range(world)]
    for p in ps:
        p.join(timeout=60)
    for rank, got, want, gathered_ok, red in res:
        assert got == want == [2, 0, 7], f"rank {rank}: gathered argmax {got}, full-row argmax {want}"
        assert gathered_ok, f"rank {rank}: all_gather (or all_gather_stacked) lost the rank order"
        assert red == world * (world + 1) / 2


def _run_record(logits, tokens, routes, dtype="torch.bfloat16"):
    return {"logits": logits, "tokens": tokens, "routes": routes, "dtype": dtype, "paths": {}}


def test_check_compare_accepts_router_near_ties_only():
    """peregrine.parallel.check: a row over the BF16 tolerance passes only at the step where that
    sequence's routed experts first differ; after it (or a token near-tie) the runs may part."""
    from peregrine.parallel.check import BF16_TOL, compare
    g = torch.Generator().manual_seed(0)
    la = [torch.randn(2, 50, generator=g) for _ in range(3)]
    lb = [x.clone() for x in la]
    lb[1][0] += 0.5 * la[1][0]                       # sequence 0, step 1: 50 % off
    ids = lambda e: [torch.tensor([[e, 7]]), torch.tensor([[1, 2]])]  # noqa: E731  [layer][rows, k]
    routes_a = [[ids(3), ids(3)] for _ in range(3)]
    routes_b = [[ids(3), ids(3)], [ids(4), ids(3)], [ids(4), ids(3)]]  # sequence 0 swaps an expert at step 1
    toks = [[1, 2, 3], [4, 5, 6]]
    ok = compare(_run_record(la, toks, routes_a), _run_record(lb, toks, routes_b))
    assert ok["ok"] and ok["first_routing_flip_per_sequence"] == [1, None]
    no_flip = compare(_run_record(la, toks, routes_a), _run_record(lb, toks, routes_a))
    assert not no_flip["ok"] and no_flip["over_tolerance"][0]["step"] == 1 and no_flip["max_rel_rmse"] > BF16_TOL
    far = [x.clone() for x in la]
    far[2][1] = -la[2][1]                            # sequence 1 picks a token far from a tie at step 2
    t_far = [[1, 2, 3], [4, 5, int(far[2][1].argmax())]]
    t_ref = [[1, 2, 3], [4, 5, int(la[2][1].argmax())]]
    bad = compare(_run_record(la, t_ref, routes_a), _run_record(far, t_far, routes_a))
    assert not bad["ok"] and bad["token_divergences_off_flips"][0]["near_tie_top5"] is False
    after = [[ids(3), ids(3)], [ids(3), ids(4)], [ids(3), ids(4)]]  # sequence 1 swapped an expert at step 1
    parted = compare(_run_record(la, t_ref, routes_a), _run_record(far, t_far, after))
    assert parted["ok"] and parted["token_divergences_off_flips"] == []  # its step-2 token follows the flip


def test_shutdown_leaves_the_group_with_the_other_ranks_and_never_hangs(monkeypatch, capsys):
    """Rank 0 leaves the group before waiting for the other ranks (their NCCL teardown may wait for it),
    and a teardown that blocks is abandoned after TEARDOWN_S, with a message."""
    import threading
    import torch.distributed as dist
    from peregrine.parallel import control
    order, release = [], threading.Event()

    def stuck_destroy():
        order.append("destroy")
        release.wait(30)

    class Rank:
        def join(self, timeout=None):
            order.append("join")

        def is_alive(self):
            return False

    monkeypatch.setattr(control, "send_obj", lambda tp, obj: order.append(obj[0]))
    monkeypatch.setattr(dist, "destroy_process_group", stuck_destroy)
    monkeypatch.setattr(launch, "TEARDOWN_S", 0.2)
    monkeypatch.setitem(launch._state, "tp", object())
    monkeypatch.setitem(launch._state, "procs", [Rank()])
    t = threading.Thread(target=launch.shutdown, daemon=True)
    t.start()
    t.join(5)
    release.set()
    assert not t.is_alive(), "shutdown hung on a blocked teardown"
    assert order == ["exit", "destroy", "join"]
    assert launch._state["tp"] is None and launch._state["procs"] == []
    assert "teardown did not finish" in capsys.readouterr().err
