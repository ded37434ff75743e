"""Weights: load HF safetensors (single file or sharded with an index), save,
and seeded dummy init. All three walk the model's hf_params() table."""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch

from ..config import ConfigError
from . import mxfp4
from ..parallel.shard import full_table
from ..parallel.slicing import slice_of, take
from .kimi import K3_PREFIX  # K3 text tensors live under it; checkpoints without it are accepted too

INDEX_FILE = "model.safetensors.index.json"
# checkpoint tensors we knowingly do not use (e.g. rotary buffers of NoPE models)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# K3 is multimodal: its vision tensors are not part of the text model we serve
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
RESHAPE_OK = ("A_log",)  # stored as [H] or [1,1,H,1] in different exports: any shape with the same squeezed form
DEFAULT_SHARD_BYTES = 4 << 30  # HF-style 4 GiB shards when saving large models
# other exporters' names for our tensors: transformers 5 saves every layer's MLP under
# `block_sparse_moe.`, so the dense layers' `mlp.{gate,up,down}_proj` come back under that prefix
NAME_ALIASES = ((re.compile(r"\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$"), r".mlp.\1"),)


class WeightError(ConfigError):
    """A checkpoint that does not match the model: names the tensor."""


def weight_files(folder: Path) -> list[Path]:
    idx = folder / INDEX_FILE
    if idx.exists():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightError(f"{idx}: not a valid safetensors index ({e})") from None
        files = sorted({folder / f for f in wm.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise WeightError(f"{idx} names shard files that do not exist: {', '.join(missing[:3])}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors weights in {folder} (use --dummy-weights to run without weights)")
    return files


def _tp_table(model) -> dict | None:
    """Sharded model: name -> (rank's view, checkpoint shape of the full tensor, full view shape, slice)."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.world == 1:
        return None
    local = {name: view for name, view, _ in model.hf_params()}
    return {name: (local[name], shape, tuple(fv.shape), slice_of(name, tuple(fv.shape), tuple(local[name].shape), tp))
            for name, fv, shape in full_table(model.full_cfg)}


def _read(fh, key: str, view_shape, sl) -> torch.Tensor:
    """A checkpoint tensor laid out as view_shape, or only a rank's slice of it, read from disk as a slice."""
    if sl is None:
        return fh.get_tensor(key)
    d, start = sl
    return fh.get_slice(key)[(slice(None),) * d + (slice(start, start + view_shape[d]),)]


def load_weights(model, folder: str | Path, log=None) -> None:
    from safetensors import safe_open

    folder = Path(folder)
    tpt = _tp_table(model)
    table = ({name: (view, shape) for name, view, shape in model.hf_params()} if tpt is None else
             {name: (view, shape) for name, (view, shape, _, _) in tpt.items()})
    seen: set[str] = set()
    ignored = 0
    t0 = time.time()
    files = weight_files(folder)
    for n, f in enumerate(files, 1):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for ckpt_key in fh.keys():
                key = _table_name(ckpt_key, table)
                if key.endswith(IGNORED_SUFFIXES):
                    continue
                if key.removeprefix(K3_PREFIX).startswith(IGNORED_PREFIXES):
                    ignored += 1
                    continue
                if key not in table:
                    raise WeightError(f"{f.name}: unexpected tensor '{ckpt_key}' (not part of this {model.cfg.model_type} model)")
                if key in seen:
                    raise WeightError(f"{f.name}: tensor '{ckpt_key}' is '{key}', which the checkpoint already holds")
                view, shape = table[key]
                if tpt is not None:  # a rank's shard: check the full shape, keep the slice
                    _load_slice(fh, ckpt_key, key, view, tpt[key], f.name)
                    seen.add(key)
                    continue
                t = fh.get_tensor(ckpt_key)
                if t.dtype == E8M0_DTYPE:  # some exports type MXFP4 scales as E8M0: the same bytes
                    t = t.view(torch.uint8)
                if not _shape_ok(key, tuple(t.shape), tuple(shape)):
                    raise WeightError(f"{f.name}: tensor '{ckpt_key}' has shape {tuple(t.shape)}, the model expects {tuple(shape)}")
                if (view.dtype == torch.uint8) != (t.dtype == torch.uint8):
                    raise WeightError(f"{f.name}: tensor '{ckpt_key}' has dtype {t.dtype}, the model expects {view.dtype}")
                with torch.no_grad():
                    view.copy_(t.reshape(view.shape))
                seen.add(key)
        if log:
            log(f"loaded shard {n}/{len(files)} {f.name} ({time.time() - t0:.1f}s)")
    if ignored and log:
        log(f"ignored {ignored} vision tensor(s): only the text model is served")
    missing = [k for k in table if k not in seen]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise WeightError(f"checkpoint in {folder} lacks tensor(s) {', '.join(missing[:3])}{more}")


def _load_slice(fh, ckpt_key: str, key: str, view, entry, fname: str) -> None:
    _, shape, fshape, sl = entry
    got = tuple(fh.get_slice(ckpt_key).get_shape())
    if not _shape_ok(key, got, tuple(shape)):
        raise WeightError(f"{fname}: tensor '{ckpt_key}' has shape {got}, the model expects {tuple(shape)}")
    if got == tuple(fshape):
        t = _read(fh, ckpt_key, view.shape, sl)
    else:  # stored in another layout (A_log): read whole, then slice
        t = take(fh.get_tensor(ckpt_key).reshape(fshape), sl, view.shape)
    if t.dtype == E8M0_DTYPE:
        t = t.view(torch.uint8)
    if (view.dtype == torch.uint8) != (t.dtype == torch.uint8):
        raise WeightError(f"{fname}: tensor '{ckpt_key}' has dtype {t.dtype}, the model expects {view.dtype}")
    with torch.no_grad():
        view.copy_(t.reshape(view.shape))


def _table_name(key: str, table: dict) -> str:
    """A checkpoint name as the model's table spells it (adds or strips K3's `language_model.`;
    another exporter's name for the tensor, NAME_ALIASES)."""
    for k in (key, *(pat.sub(rep, key) for pat, rep in NAME_ALIASES if pat.search(key))):
        if k in table:
            return k
        if k.startswith(K3_PREFIX) and k[len(K3_PREFIX):] in table:
            return k[len(K3_PREFIX):]
        if K3_PREFIX + k in table:
            return K3_PREFIX + k
    return key


def _shape_ok(key: str, got: tuple, want: tuple) -> bool:
    if got == want:
        return True
    squeeze = lambda s: tuple(x for x in s if x != 1)  # noqa: E731
    return key.endswith(RESHAPE_OK) and squeeze(got) == squeeze(want)


def save_weights(model, folder: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write HF-named safetensors; shards plus an index when larger than one shard."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], {}, 0
    for name, view, shape in model.hf_params():
        t = view.detach().reshape(shape).contiguous().cpu()
        if cur and size + t.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t, size + t.nbytes
    shards.append(cur)
    if len(shards) == 1:
        paths = [folder / "model.safetensors"]
        save_file(shards[0], str(paths[0]), metadata={"format": "pt"})
        return paths
    paths, wm = [], {}
    for i, sh in enumerate(shards, 1):
        p = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(p), metadata={"format": "pt"})
        paths.append(p)
        wm.update({k: p.name for k in sh})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}, indent=1))
    return paths


# ---- dummy weights ----------------------------------------------------------
# write into the residual stream (K3: routed_expert_up_proj; the routed w2 feeds a norm there)
OUT_PROJ_NAMES = ("o_proj.weight", "down_proj.weight", "w2.weight", "routed_expert_up_proj.weight")


def _init_one(name: str, view: torch.Tensor, shape, num_layers: int, gen: torch.Generator,
              scales: dict | None = None, latent: bool = False) -> None:
    """`scales`: MXFP4 weight_scale views by name; `latent`: routed w2 feeds a norm, not the residual."""
    base = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
    residual = name.endswith(OUT_PROJ_NAMES) and not (latent and ".experts." in name)
    if name.endswith(".weight_scale"):
        return  # set together with its weight_packed (MXFP4)
    if name.endswith(".weight_packed"):
        std = (2 * shape[1]) ** -0.5  # fan-in: two values a byte
        if name.endswith("w2.weight_packed") and not latent:
            std /= math.sqrt(2 * num_layers)
        mxfp4.random_fill(view, scales[name.removesuffix("_packed") + "_scale"], std, gen)
    elif "norm" in base.rsplit(".", 1)[-1]:
        view.fill_(1.0)
    elif name.endswith("A_log"):
        # decay rates exp(A_log) in [1, 16], as KDA initialises them
        view.copy_(torch.empty(view.shape, device=view.device).uniform_(1, 16, generator=gen).log())
    elif name.endswith("dt_bias"):
        # inverse softplus of dt ~ logUniform(1e-3, 1e-1): the usual delta-rule time-step init
        dt = torch.empty(view.shape, device=view.device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        view.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif name.endswith("e_score_correction_bias"):
        view.normal_(0.0, 0.01, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        view.normal_(0.0, 1.0, generator=gen)
    else:
        fan_in = math.prod(shape[1:])
        std = fan_in ** -0.5
        if residual:
            std /= math.sqrt(2 * num_layers)  # GPT-2 style: the residual stream stays O(1) through depth
        if "conv1d" in name:
            std = 0.5  # 4-tap conv: keeps SiLU(conv) of O(1) inputs at O(1)
        view.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_dummy_weights(model, seed: int = 0, log=None) -> None:
    """Seeded random weights, scaled so activations neither vanish nor explode through depth."""
    dev = model.embed_tokens.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    table = model.hf_params()
    cfg = model.cfg
    scales = {name: view for name, view, _ in table if name.endswith(".weight_scale")}
    latent = cfg.routed_expert_hidden_size is not None
    # AttnRes restarts the residual stream every block: depth scaling counts the layers of one block
    depth = min(cfg.num_hidden_layers, cfg.attn_res_block_size or cfg.num_hidden_layers)
    t0 = time.time()
    tpt = _tp_table(model)
    if tpt is not None:
        return _init_dummy_shard(tpt, dev, depth, gen, latent, log)
    for n, (name, view, shape) in enumerate(table):
        _init_one(name, view, shape, depth, gen, scales, latent)
        if log and (n + 1) % 5000 == 0:
            log(f"dummy init {n + 1}/{len(table)} tensors ({time.time() - t0:.1f}s)")


def _init_dummy_shard(tpt: dict, dev, depth: int, gen, latent: bool, log) -> None:
    """A rank's shard: every full tensor is generated in the one-rank order (same generator
    stream), then the rank keeps its slice, so TP = N holds exactly TP = 1's weights."""
    t0, stash = time.time(), {}
    for n, (name, (view, shape, fshape, sl)) in enumerate(tpt.items()):
        if name.endswith(".weight_scale"):
            full = stash.pop(name)  # filled with its weight_packed
        else:
            full = torch.empty(fshape, dtype=view.dtype, device=dev)
            if name.endswith(".weight_packed"):
                sname = name.removesuffix("_packed") + "_scale"
                stash[sname] = torch.empty(tpt[sname][2], dtype=torch.uint8, device=dev)
            _init_one(name, full, shape, depth, gen, stash, latent)
        view.copy_(take(full, sl, view.shape))
        if log and (n + 1) % 5000 == 0:
            log(f"dummy init {n + 1}/{len(tpt)} tensors ({time.time() - t0:.1f}s)")
