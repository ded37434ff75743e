"""Golden outputs of DeepSeek's DeepSpec DSpark drafter (Qwen3DSparkModel: DFlash layers, the vanilla Markov head
and the confidence head) on a small random config, FP32 on the CPU, for tests/test_dflash.py. DeepSpec is not on
PyPI: run this with its source on the path (deepseek-ai/DeepSpec at afdfa7c, MIT) and transformers 5.x:
    PYTHONPATH=/path/to/DeepSpec python tests/golden/make_dspark_golden.py
Writes tests/golden/dspark_small.json (the drafter's config.json, DeepSpec's flat layout) and
tests/golden/dspark_small.safetensors (its weights, under their checkpoint names, and the case: taps, block ids,
block states, Markov-corrected logits, greedy drafts, confidence logits)."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel

OUT = Path(__file__).parent
V, H, C, BLOCK = 128, 64, 7, 5


def main():
    d = dict(architectures=["Qwen3DSparkModel"], model_type="qwen3", hidden_size=H, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             rope_theta=10000.0, vocab_size=V, max_position_embeddings=512, tie_word_embeddings=False,
             layer_types=["full_attention"] * 2, num_target_layers=6, block_size=BLOCK, mask_token_id=V - 1,
             target_layer_ids=[-1, 2, 5], num_anchors=8, markov_rank=8, markov_head_type="vanilla",
             enable_confidence_head=True, confidence_head_with_markov=True, attention_bias=False)
    cfg = Qwen3Config(**{k: v for k, v in d.items() if k != "architectures"})
    for k in ("num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "num_anchors", "markov_rank",
              "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        setattr(cfg, k, d[k])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = Qwen3DSparkModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(1, C, 3 * H, generator=g)
    ids = torch.full((1, BLOCK), V - 1, dtype=torch.long)
    ids[0, 0] = 42
    with torch.no_grad():
        h = m._forward_backbone(position_ids=torch.arange(C + BLOCK)[None], noise_embedding=m.embed_tokens(ids),
                                target_hidden_states=taps, attention_mask=None, is_causal=False)
        toks, logits = m.sample_draft_tokens(m.compute_logits(h), first_prev_token_ids=ids[:, 0], temperature=0.0,
                                             hidden_states=h)
        conf = m.predict_confidence_step(h, prev_token_ids=torch.cat([ids[:, :1], toks[:, :-1]], 1))
    tensors = {k: v.contiguous() for k, v in m.state_dict().items() if "rotary" not in k}
    tensors |= {"case.taps": taps[0], "case.ids": ids[0], "case.hidden": h[0], "case.logits": logits[0],
                "case.drafts": toks[0], "case.confidence_logits": conf[0]}
    (OUT / "dspark_small.json").write_text(json.dumps(d, indent=1) + "\n")
    save_file(tensors, str(OUT / "dspark_small.safetensors"))
    print("wrote", OUT / "dspark_small.json", "and", OUT / "dspark_small.safetensors", f"drafts {toks[0].tolist()}")


if __name__ == "__main__":
    main()
