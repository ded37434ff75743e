"""Model and engine configuration.

ModelConfig is parsed from a Hugging Face ``config.json`` (``model_type``
``kimi_linear``, or ``kimi_k3`` with the text part nested under
``text_config``). Every field the runtime reads is validated here so a bad
file fails with a message naming the field, never deep inside the model.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import ConfigError
from .generation_config import GenerationConfig

PRESET_DIR = Path(__file__).parent / "presets"
# eps of the MLA latent norms (kv_a_layernorm, q_a_layernorm) when config.json has no "mla_norm_eps":
# transformers' and Moonshot's modeling code use 1e-6 there whatever rms_norm_eps says
MLA_NORM_EPS = 1e-6


def _req(d: dict, key: str, typ, where: str, *, positive: bool = False, default=...):
    if key not in d or d[key] is None:
        if default is not ...:
            return default
        raise ConfigError(f"{where}: missing required field '{key}'")
    v = d[key]
    ok = isinstance(v, typ) and not (typ in (int, (int, float)) and isinstance(v, bool))
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        raise ConfigError(f"{where}: field '{key}' must be {getattr(typ, '__name__', typ)}, got {v!r}")
    if positive and not v > 0:
        raise ConfigError(f"{where}: field '{key}' must be > 0, got {v!r}")
    return v


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    # layer kinds, 0-based
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    kda_gate_lower_bound: float | None  # None: softplus gate (Kimi-Linear); else bounded sigmoid gate (K3)
    kda_full_rank_gate: bool            # output gate W_g x (K3) vs low-rank W_gb W_ga x
    # MLA
    mla_num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    mla_norm_eps: float                 # eps of kv_a_layernorm / q_a_layernorm
    # FFN
    hidden_act: str                     # silu (SwiGLU) or situ
    intermediate_size: int              # dense layers
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    moe_renormalize: bool
    routed_expert_hidden_size: int | None  # K3 latent MoE width
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int | None     # K3 AttnRes
    expert_quant: str | None            # None (BF16) or "mxfp4"
    # tokens
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    name: str = "model"
    # end ids besides eos_token_id: the rest of config.json's list, generation_config.json's
    extra_eos_token_ids: tuple[int, ...] = ()

    # ---- derived ----
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, eos_token_id first."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys(first + self.extra_eos_token_ids))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA cache entry: the normalised latent c and k_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    def is_kda(self, i: int) -> bool:
        return i in self.kda_layers

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ---- parsing ----
    @classmethod
    def from_dict(cls, raw: dict, name: str = "model", where: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        mt = raw.get("model_type")
        if mt not in ("kimi_linear", "kimi_k3"):
            raise ConfigError(f"{where}: field 'model_type' must be 'kimi_linear' or 'kimi_k3', got {mt!r}")
        top = raw
        if mt == "kimi_k3" and "text_config" in raw:
            raw = raw["text_config"]
            if not isinstance(raw, dict):
                raise ConfigError(f"{where}: field 'text_config' must be an object")
            where = f"{where} (text_config)"
        d = raw
        lac = _req(d, "linear_attn_config", dict, where)
        lw = f"{where}: linear_attn_config"
        L = _req(d, "num_hidden_layers", int, where, positive=True)
        kda = _req(lac, "kda_layers", list, lw)
        full = _req(lac, "full_attn_layers", list, lw)
        for lst, key in ((kda, "kda_layers"), (full, "full_attn_layers")):
            for x in lst:
                if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= L:
                    raise ConfigError(f"{lw}: '{key}' entries must be 1-based layer numbers in 1..{L}, got {x!r}")
        if set(kda) & set(full):
            raise ConfigError(f"{lw}: layers {sorted(set(kda) & set(full))} are in both kda_layers and full_attn_layers")
        if set(kda) | set(full) != set(range(1, L + 1)):
            missing = sorted(set(range(1, L + 1)) - set(kda) - set(full))
            raise ConfigError(f"{lw}: layers {missing} are in neither kda_layers nor full_attn_layers")
        if not d.get("mla_use_nope", False):
            raise ConfigError(f"{where}: field 'mla_use_nope' must be true (rotary MLA is not part of this family)")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "situ"):
            raise ConfigError(f"{where}: field 'hidden_act' must be 'silu' or 'situ', got {act!r}")
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"{where}: field 'moe_router_activation_func' must be 'sigmoid'")
        qc = d.get("quantization_config") or top.get("quantization_config")
        quant = None
        if qc:
            fmt = str(qc.get("format", ""))
            if "mxfp4" not in fmt:
                raise ConfigError(f"{where}: unsupported quantization_config format {fmt!r} (only MXFP4 experts)")
            quant = "mxfp4"
        q_lora = d.get("q_lora_rank")
        if q_lora is not None:
            q_lora = _req(d, "q_lora_rank", int, where, positive=True)
        lb = lac.get("gate_lower_bound")
        if lb is not None:
            lb = float(_req(lac, "gate_lower_bound", float, lw))
        reh = d.get("routed_expert_hidden_size")
        if reh is not None:
            reh = _req(d, "routed_expert_hidden_size", int, where, positive=True)
        arb = d.get("attn_res_block_size")
        if arb is not None:
            arb = _req(d, "attn_res_block_size", int, where, positive=True)
        num_experts = _req(d, "num_experts", int, where, positive=True)
        topk = _req(d, "num_experts_per_token", int, where, positive=True)
        if topk > num_experts:
            raise ConfigError(f"{where}: 'num_experts_per_token' ({topk}) exceeds 'num_experts' ({num_experts})")
        eos = top.get("eos_token_id", d.get("eos_token_id"))
        eos_all = tuple(x for x in (eos if isinstance(eos, list) else [eos]) if isinstance(x, int) and not isinstance(x, bool))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        cfg = cls(
            model_type=mt,
            hidden_size=_req(d, "hidden_size", int, where, positive=True),
            num_hidden_layers=L,
            vocab_size=_req(d, "vocab_size", int, where, positive=True),
            rms_norm_eps=_req(d, "rms_norm_eps", float, where, positive=True),
            kda_layers=tuple(sorted(x - 1 for x in kda)),
            mla_layers=tuple(sorted(x - 1 for x in full)),
            kda_num_heads=_req(lac, "num_heads", int, lw, positive=True),
            kda_head_dim=_req(lac, "head_dim", int, lw, positive=True),
            kda_conv_size=_req(lac, "short_conv_kernel_size", int, lw, positive=True),
            kda_gate_lower_bound=lb,
            kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            mla_num_heads=_req(d, "num_attention_heads", int, where, positive=True),
            q_lora_rank=q_lora,
            kv_lora_rank=_req(d, "kv_lora_rank", int, where, positive=True),
            qk_nope_head_dim=_req(d, "qk_nope_head_dim", int, where, positive=True),
            qk_rope_head_dim=_req(d, "qk_rope_head_dim", int, where, positive=True),
            v_head_dim=_req(d, "v_head_dim", int, where, positive=True),
            mla_output_gate=bool(d.get("mla_use_output_gate", False)),
            mla_norm_eps=float(_req(d, "mla_norm_eps", float, where, default=MLA_NORM_EPS)),
            hidden_act=act,
            intermediate_size=_req(d, "intermediate_size", int, where, positive=True),
            first_k_dense_replace=_req(d, "first_k_dense_replace", int, where, default=0),
            moe_layer_freq=_req(d, "moe_layer_freq", int, where, positive=True, default=1),
            num_experts=num_experts,
            num_experts_per_token=topk,
            moe_intermediate_size=_req(d, "moe_intermediate_size", int, where, positive=True),
            num_shared_experts=_req(d, "num_shared_experts", int, where, default=0),
            routed_scaling_factor=_req(d, "routed_scaling_factor", float, where, positive=True, default=1.0),
            moe_renormalize=bool(d.get("moe_renormalize", True)),
            routed_expert_hidden_size=reh,
            situ_beta=float(d.get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(d.get("activation_situ_linear_beta", 25.0)),
            attn_res_block_size=arb,
            expert_quant=quant,
            bos_token_id=top.get("bos_token_id", d.get("bos_token_id")),
            eos_token_id=eos,
            pad_token_id=top.get("pad_token_id", d.get("pad_token_id")),
            max_position_embeddings=int(d.get("model_max_length") or d.get("max_position_embeddings") or top.get("model_max_length") or 131072),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", False)),
            name=name,
            extra_eos_token_ids=eos_all[1:],
        )
        if cfg.num_shared_experts < 0:
            raise ConfigError(f"{where}: field 'num_shared_experts' must be >= 0")
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike, name: str | None = None) -> "ModelConfig":
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(raw, name=name or p.parent.name, where=str(p))


def with_generation_config(cfg: ModelConfig, folder: Path) -> ModelConfig:
    """The config with generation_config.json's end ids added to its own (config.json's first)."""
    import dataclasses
    extra = GenerationConfig.from_folder(folder).eos_token_ids
    if not extra:
        return cfg
    ids = tuple(dict.fromkeys(cfg.eos_token_ids + extra))
    return dataclasses.replace(cfg, eos_token_id=ids[0], extra_eos_token_ids=ids[1:])


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # a Hugging Face model id: owner/name


def hub_cache() -> Path:
    """Where Hugging Face keeps downloaded models (its own environment variables, then its default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def cached_snapshot(model_id: str) -> Path | None:
    """The Hugging Face cache's copy of model_id (its main revision, else the newest snapshot holding config.json)."""
    entry = hub_cache() / ("models--" + model_id.replace("/", "--"))
    ref = entry / "refs" / "main"
    if ref.is_file():
        snap = entry / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = sorted((p for p in (entry / "snapshots").glob("*") if (p / "config.json").is_file()),
                   key=lambda p: p.stat().st_mtime) if (entry / "snapshots").is_dir() else []
    return snaps[-1] if snaps else None


def fetch_model(model_id: str) -> Path:
    """model_id's folder: the Hugging Face cache's copy, else downloaded through huggingface_hub (vLLM's way); else a
    ConfigError saying where it looked and how to fetch it."""
    snap = cached_snapshot(model_id)
    if snap is not None:
        return snap
    why = "huggingface_hub is not installed (pip install huggingface_hub)"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        snapshot_download = None
    if snapshot_download is not None:
        try:
            return Path(snapshot_download(model_id))
        except Exception as e:  # offline, unknown id, gated: one line, not a traceback
            why = f"the download failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    raise ConfigError(f"model '{model_id}' is not a folder, not a preset and not in the Hugging Face cache "
                      f"({hub_cache()}), and {why}: fetch it with `hf download {model_id}` (or pass its folder)")


def resolve_model(model: str) -> tuple[ModelConfig, Path | None]:
    """A preset name, a model folder or a Hugging Face id -> (config, folder holding weights or None)."""
    p = Path(model)
    if not p.is_dir() and HF_ID.match(model) and not (PRESET_DIR / f"{model}.json").exists():
        p = fetch_model(model)
    if p.is_dir():
        cfgp = p / "config.json"
        if not cfgp.exists():
            raise ConfigError(f"model folder {p} has no config.json")
        return with_generation_config(ModelConfig.from_json(cfgp, name=p.name), p), p
    if (PRESET_DIR / f"{model}.json").exists():
        weights = PRESET_DIR / model
        return ModelConfig.from_json(PRESET_DIR / f"{model}.json", name=model), (weights if weights.is_dir() else None)
    if os.sep in model or model.startswith("."):
        raise ConfigError(f"model folder not found: {model}")
    raise ConfigError(f"unknown model '{model}': not a folder, and not a preset (presets: {', '.join(preset_names())})")


# ----------------------------------------------------------------------------
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's switch for the same mode, honoured as --batch-invariant
INVARIANT_ALIGN = 64  # batch-invariant mode's KDA chunk (fla's BT): block sizes, prefix hits, prefill chunk ends and
#   snapshot cuts are its multiples in that mode, so a prompt's KDA chunks are the same however the prompt is split
DECODE_BACKENDS = ("standard", "latency_specialized")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
TP_ALLREDUCE = ("auto", "nccl")


# the default prefill step budget (--max-num-batched-tokens): the largest whose activations fit beside the
# caches (engine/build.py); a step of 32K tokens runs the MoE's grouped GEMMs at ~1K tokens an expert (H200,
# 48B: a cold 32K prompt in one step 665.7 ms vs 768.7 in four of 8K, results/2026-12-02-session10)
PREFILL_STEP_TOKENS = (32768, 16384, 8192)


@dataclass
class EngineConfig:
    max_num_seqs: int = 8
    max_model_len: int | None = None          # default: one GPU: what its memory holds (engine/parts.py); else min(model limit, 4096)
    # prompt tokens per step when nobody is decoding: long prompts in few, compute-bound steps
    # (every step of a 48B MoE reads nearly every expert once it holds ~1K tokens). None: the engine picks
    # the largest of 32K / 16K / 8K whose activations fit beside the caches (engine/build.py)
    max_num_batched_tokens: int | None = None
    # prompt tokens in a step that also carries decodes: bounds how long a running request waits
    # for a token while another prompt prefills (the inter-token latency tail)
    max_prefill_tokens_while_decoding: int = 2048
    # such a chunk runs in pieces of this many layers, a decode step of the running requests between two
    # pieces, so they wait ~one piece per token instead of the whole chunk (None: as many layers as fit
    # prefill_piece_ms, measured as the chunk runs (engine/pieces.py); 0: off, the chunk and the decodes share
    # one step; tensor parallel: off)
    prefill_piece_layers: int | None = None
    prefill_piece_ms: float | None = None      # a piece's time budget (None: engine/pieces.py PIECE_MS, 12 ms)
    enable_prefix_caching: bool = True        # reuse cached MLA blocks + KDA snapshots of earlier prompts
    prefix_cache_snapshots: int | None = None  # KDA state snapshots kept (default: sized from memory)
    block_size: int = 64                      # tokens per MLA cache block
    num_cache_blocks: int | None = None       # default: sized from memory
    kv_cache_dtype: str = "auto"
    decode_backend: str = "standard"
    max_decode_batch: int = 8                 # largest B served by the specialized path
    cuda_graphs: bool = True
    # prefill steps' token-parallel work (everything but the attention cores) replayed from CUDA graphs
    # per token bucket: an eager 1-2K-token step is host-bound (needs cuda_graphs; BF16, one GPU, no AttnRes)
    prefill_graphs: bool = True
    decode_lookahead: bool = True             # launch the next greedy decode step before reading this one's tokens
    device: str | None = None                 # default: cuda if available
    dtype: str | None = None                  # default: bf16 on cuda, fp32 on cpu
    seed: int = 0
    gpu_memory_utilization: float = 0.90
    tensor_parallel_size: int = 1             # ranks, one process (one GPU) each
    pdl: bool = True                          # specialized path: Programmatic Dependent Launch on Hopper (H200: B=1 step 3.06 -> 2.74 ms)
    tp_allreduce: str = "auto"                # specialized path: "auto" (one-shot symmetric memory, else NCCL) or "nccl"
    # TP: router logits and MLA latent/q-down projections as a slice per rank + all-gather (true), or
    # computed whole on every rank (false: no extra collective, the default until measured on the GPU)
    tp_slice_replicated: bool = False
    # --batch-invariant (or vLLM's VLLM_BATCH_INVARIANT=1): a request's tokens and logprobs do not depend on the batch
    # (docs/correctness.md §5); the fused kernels plan from static sizes only
    batch_invariant: bool = field(default_factory=lambda: os.environ.get(BATCH_INVARIANT_ENV, "0") == "1")
    speculative_config: object = None         # --speculative-config (peregrine.speculative.config.SpeculativeConfig, dict or JSON)
    extra: dict = field(default_factory=dict)

    ADDITIONAL_KEYS = {
        "decode_backend": DECODE_BACKENDS,
        "max_decode_batch": "int in 1..16",
        "cuda_graphs": "bool",
        "prefill_graphs": "bool",
        "decode_lookahead": "bool",
        "tp_allreduce": TP_ALLREDUCE,
        "pdl": "bool",
        "tp_slice_replicated": "bool",
        "prefix_cache_snapshots": "int >= 0",
        "prefill_piece_layers": "int >= 0 (0: off)",
        "prefill_piece_ms": "number > 0",
    }
    # what each key does, for docs/configuration.md (python -m peregrine.reference renders it; tests/test_docs.py
    # checks that every key has a description)
    ADDITIONAL_HELP = {
        "decode_backend": "The path that serves pure decode steps. latency_specialized is the fast path on a GPU: "
                          "fused kernels, one CUDA graph per batch size. standard serves every step and is the "
                          "reference. Steps the fast path cannot serve go to standard.",
        "max_decode_batch": "The largest batch the latency_specialized path serves. Larger decode steps go to "
                            "standard.",
        "cuda_graphs": "Replay steps from captured CUDA graphs. false runs every step eagerly (slower, no capture "
                       "at start).",
        "prefill_graphs": "Replay the token-parallel work of prefill steps from CUDA graphs, one set per token "
                          "bucket, captured at start. Needs cuda_graphs. Off (logged) under tensor parallel, with "
                          "AttnRes layers (K3), in FP32, and for MXFP4 experts without the grouped kernel.",
        "decode_lookahead": "Launch the next decode step before this step's tokens are read back. Stop checks then "
                            "run one step late.",
        "tp_allreduce": "Tensor parallel, latency_specialized path: how the output projections are summed. auto "
                        "uses a one-shot all-reduce over symmetric memory where it is available, else NCCL.",
        "pdl": "latency_specialized path on Hopper: Programmatic Dependent Launch, so each kernel starts while the "
               "one before it drains.",
        "tp_slice_replicated": "Tensor parallel: give each rank a slice of the router and of the MLA latent "
                               "projections, joined by an all-gather. Measured slower at B <= 8, so off.",
        "prefix_cache_snapshots": "KDA state snapshots the prefix cache keeps. null: 64 (engine/parts.py), shrunk "
                                  "on one GPU to what fits beside the caches.",
        "prefill_piece_layers": "Same as --prefill-piece-layers: layers per prefill piece beside running decodes. "
                                "null: sized by prefill_piece_ms on a GPU, 6 on the CPU. 0: off. Always off under "
                                "tensor parallel.",
        "prefill_piece_ms": "Time budget of one prefill piece on a GPU. null: 12 ms (engine/pieces.py).",
    }

    def apply_additional_config(self, text_or_dict) -> None:
        d = text_or_dict
        if isinstance(d, str):
            try:
                d = json.loads(d) if d.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"--additional-config is not valid JSON: {e.msg}") from None
        if not isinstance(d, dict):
            raise ConfigError("--additional-config must be a JSON object")
        for k, v in d.items():
            if k not in self.ADDITIONAL_KEYS:
                raise ConfigError(f"--additional-config: unknown key '{k}' (valid keys: {', '.join(self.ADDITIONAL_KEYS)})")
            if k == "decode_backend" and v not in DECODE_BACKENDS:
                raise ConfigError(f"--additional-config: decode_backend must be one of {', '.join(DECODE_BACKENDS)}, got {v!r}")
            if k == "max_decode_batch" and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 16):
                raise ConfigError(f"--additional-config: max_decode_batch must be an int in 1..16, got {v!r}")
            if k == "tp_allreduce" and v not in TP_ALLREDUCE:
                raise ConfigError(f"--additional-config: tp_allreduce must be one of {', '.join(TP_ALLREDUCE)}, got {v!r}")
            if k in ("prefix_cache_snapshots", "prefill_piece_layers") and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"--additional-config: {k} must be an int >= 0, got {v!r}")
            if k == "prefill_piece_ms" and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf")):
                raise ConfigError(f"--additional-config: prefill_piece_ms must be a number > 0, got {v!r}")
            if k in ("cuda_graphs", "prefill_graphs", "pdl", "decode_lookahead", "tp_slice_replicated") and not isinstance(v, bool):
                raise ConfigError(f"--additional-config: {k} must be true or false, got {v!r}")
            setattr(self, k, v)

    def validate(self) -> None:
        if self.speculative_config and self.tensor_parallel_size > 1:
            raise ConfigError("--speculative-config does not work with --tensor-parallel-size > 1 yet: "
                              "use one of them")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.batch_invariant and self.decode_backend == "latency_specialized" and self.max_num_seqs > self.max_decode_batch:
            raise ConfigError(f"--batch-invariant with latency_specialized needs --max-num-seqs <= max_decode_batch "
                              f"({self.max_decode_batch}), got {self.max_num_seqs}: a larger decode step would take the "
                              "standard path, whose bits differ from the fused kernels'")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ConfigError("--batch-invariant does not work with --tensor-parallel-size > 1 yet: the all-reduce "
                              "picks its algorithm, and so its summation order, by the message's size (the batch's)")
        if self.batch_invariant:
            small = [f"{name} {v}" for name, v in (("block_size", self.block_size),
                                                    ("--max-num-batched-tokens", self.max_num_batched_tokens),
                                                    ("max_prefill_tokens_while_decoding",
                                                     self.max_prefill_tokens_while_decoding)) if v is not None
                     and (v % INVARIANT_ALIGN if name == "block_size" else v < INVARIANT_ALIGN)]
            if small:
                raise ConfigError(f"--batch-invariant needs a block size that is a multiple of {INVARIANT_ALIGN} and "
                                  f"prefill budgets of at least {INVARIANT_ALIGN} tokens (a prompt is split only at "
                                  f"multiples of the KDA chunk, {INVARIANT_ALIGN}), got {', '.join(small)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding < 1:
            raise ConfigError(f"max_prefill_tokens_while_decoding must be >= 1, got {self.max_prefill_tokens_while_decoding}")
        if self.prefill_piece_layers is not None and self.prefill_piece_layers < 0:
            raise ConfigError(f"prefill_piece_layers must be >= 0 (0: off), got {self.prefill_piece_layers}")
        if self.prefix_cache_snapshots is not None and self.prefix_cache_snapshots < 0:
            raise ConfigError(f"prefix_cache_snapshots must be >= 0, got {self.prefix_cache_snapshots}")
