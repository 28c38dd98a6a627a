"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) written by transformers itself
(save_pretrained, so the tensor names and config fields are the ones it publishes), with the
tiny checkpoints' tokenizer beside them.

The weights are drawn again after transformers' own initialisation: embeddings and LM head of
std 1 (logits far apart, so greedy decoding has no near-ties that float rounding could flip),
projections and routers of std fan_in**-0.5 (router logits of std ~1: distinct top-k picks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from tandem.engine.checkpoints import write_tiny_checkpoint

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe")

_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)
_FAMILY = {
    "mixtral": dict(num_local_experts=6, intermediate_size=96, rope_theta=10000.0),
    # qk-norm, an explicit head_dim, renormalised top-k; layer 0 dense (mlp_only_layers).
    "qwen3_moe": dict(
        num_experts=8,
        moe_intermediate_size=48,
        intermediate_size=128,
        head_dim=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        num_hidden_layers=3,
    ),
    # q/k/v biases, a shared expert with its sigmoid gate, top-k weights not renormalised.
    "qwen2_moe": dict(
        num_experts=4,
        moe_intermediate_size=32,
        intermediate_size=128,
        shared_expert_intermediate_size=80,
        norm_topk_prob=False,
    ),
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                noise = torch.randn(param.shape, generator=gen) * 0.1
            elif "embed_tokens" in name or "lm_head" in name:
                base, noise = 0.0, torch.randn(param.shape, generator=gen)
            else:
                base = 0.0
                noise = torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5
            param.copy_(base + noise)


def write_tiny_moe_checkpoint(
    out_dir: str | Path, model_type: str, seed: int = 0, **overrides
) -> Path:
    """A tiny random `model_type` (MOE_MODEL_TYPES) checkpoint in out_dir; overrides replace
    config fields."""
    out = Path(out_dir)
    tiny = write_tiny_checkpoint(out.with_name(out.name + "-tokenizer"), "llama", seed)
    raw = json.loads((tiny / "config.json").read_text())
    fields = {
        **_COMMON,
        **_FAMILY[model_type],
        "vocab_size": raw["vocab_size"],
        "bos_token_id": raw["bos_token_id"],
        "eos_token_id": raw["eos_token_id"],
        "pad_token_id": raw["pad_token_id"],
        **overrides,
    }
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        shutil.copy(tiny / name, out / name)
    shutil.rmtree(tiny)
    return out
