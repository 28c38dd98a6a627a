"""Deterministic tiny checkpoints in standard HF format (the default model and test fixtures).

Same arguments -> byte-identical files, and transformers' AutoModelForCausalLM /
AutoTokenizer load them offline, which makes transformers usable as the oracle.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.engine.tiny_tokenizer import BOS, EOS, PAD, UNK, SPECIAL_TOKENS, build_tiny_tokenizer

DEFAULT_MODEL_NAME = "tiny-llama-v1"

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _tiny_config(model_type: str, vocab_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, head_dim=16)
    elif model_type == "qwen2":
        # Small Qwen2 checkpoints tie the LM head to the embeddings; cover that path.
        config.update(tie_word_embeddings=True, use_sliding_window=False, sliding_window=None)
    elif model_type == "qwen3":
        # head_dim deliberately != hidden_size / num_heads: Qwen3 sets it explicitly.
        config.update(head_dim=32, attention_bias=False, use_sliding_window=False, sliding_window=None)
    return config


def _tiny_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    # Large-variance embeddings and LM head make logits far apart (std ~8), so greedy
    # decoding has no near-ties that float rounding could flip between implementations.
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return randn(out_features, in_features, std=in_features ** -0.5)

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + randn(dim, std=0.1)

    weights = {"model.embed_tokens.weight": randn(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        for name, out_features in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            weights[p + f"self_attn.{name}_proj.weight"] = linear(out_features, hidden)
            if config["model_type"] == "qwen2":
                weights[p + f"self_attn.{name}_proj.bias"] = randn(out_features, std=0.1)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        if config["model_type"] == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = randn(config["vocab_size"], hidden, std=1.0)
    return {name: t.contiguous() for name, t in weights.items()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tiny_checkpoint(out_dir: str | Path, model_type: str = "llama", seed: int = 0) -> Path:
    """Writes a tiny random `model_type` checkpoint with a real tokenizer into out_dir."""
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"unsupported tiny model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(model_type, tokenizer.get_vocab_size())
    _write_json(out / "config.json", config)
    save_file(_tiny_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {
        **special,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    })
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    })
    return out


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem")


def default_model_dir() -> Path:
    """The default tiny Llama at $TANDEM_HOME/models/tiny-llama-v1, written on first use."""
    target = tandem_home() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: concurrent callers never see a partial directory,
    # and the loser of a race just discards its copy.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        write_tiny_checkpoint(tmp, "llama", seed=0)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
