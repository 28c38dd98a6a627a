"""Tiny random checkpoints of the families beyond Llama, built with transformers' own config and
model classes (a few layers, hidden 64, the tiny tokenizer's vocabulary), as transformers' tests do.

The weights are redrawn with large variances (as checkpoints.write_tiny_checkpoint does) so the
logits are far apart and greedy decoding has no near-ties that float rounding could flip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from tandem.engine.checkpoints import write_tiny_checkpoint
from tandem.engine.tiny_tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS

WINDOW = 8  # shorter than every test prompt

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "eos_token_id": SPECIAL_TOKENS.index(EOS),
    "pad_token_id": SPECIAL_TOKENS.index(PAD),
    "tie_word_embeddings": False,
}

# name -> (config class, its arguments beyond _COMMON)
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "mistral": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    "qwen2_window": (
        transformers.Qwen2Config,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "gemma2": (
        transformers.Gemma2Config,
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            "tie_word_embeddings": True,
        },
    ),
    "phi3": (
        transformers.Phi3Config,
        {
            "sliding_window": WINDOW,
            "max_position_embeddings": 128,
            "original_max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
            },
        },
    ),
    "olmo2": (transformers.Olmo2Config, {}),
    "granite": (
        transformers.GraniteConfig,
        {
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.3,
            "attention_multiplier": 0.125,
            "logits_scaling": 2.0,
        },
    ),
    "qwen2_yarn": (
        transformers.Qwen2Config,
        {
            "max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama_dynamic": (
        transformers.LlamaConfig,
        {
            "max_position_embeddings": 32,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "llama_linear": (
        transformers.LlamaConfig,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
}


def _redraw(model: torch.nn.Module, seed: int, norm_center: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(norm_center + 0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)
            else:  # biases
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def write_family_checkpoint(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family` (a FAMILIES key) with the tiny tokenizer, in out_dir."""
    config_class, extra = FAMILIES[family]
    out = write_tiny_checkpoint(out_dir, "llama", seed=seed)  # the tokenizer files
    (out / "model.safetensors").unlink()
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(out))
    config = config_class(**{**_COMMON, "vocab_size": vocab_size, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Gemma's norms scale by (1 + weight): centre the stored weight on 0 there.
    _redraw(model, seed, 0.0 if config.model_type.startswith("gemma") else 1.0)
    model.save_pretrained(out)
    return out
