"""Writes the tiny HF checkpoints as GGUF files, the way llama.cpp's convert_hf_to_gguf.py does.

A GGUF of a known checkpoint makes the converter testable in a second: converting it back
must give the original tensors (F32) and tokenizer, and transformers' GGUF loader is the
oracle for quantized tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def _gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[part]}.{suffix}"


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's rotary permutation of q/k rows (LlamaModel.permute in convert_hf_to_gguf.py)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(model_dir: Path, out_path: Path, quantization: str = "F32") -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    arch = config["model_type"]
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda item: item[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab]
    )
    writer.add_token_merges(
        [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_unk_token_id(tok["model"]["vocab"][tok["model"]["unk_token"]])
    writer.add_add_bos_token(tok_config.get("add_bos_token", False))
    writer.add_chat_template(tok_config["chat_template"])
    qtype = gguf.GGMLQuantizationType[quantization]
    for name, weight in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if arch == "llama" and ".q_proj." in name:
            weight = _permute(weight, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            weight = _permute(weight, config["num_key_value_heads"])
        if weight.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), gguf.quantize(weight, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
