"""GGUF checkpoints: converted once into a cached Hugging Face-style directory.

A `.gguf` file becomes config.json, model.safetensors (in the checkpoint's own width, see
checkpoint_dtype), tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json under
$TANDEM_HOME/models/, keyed by the file's content hash. Everything downstream (the loader,
the tokenizer, GetTokenizer, the KV layout hash, update_weights) then reads a plain
checkpoint directory. Names and the Q/K un-permutation follow transformers' GGUF loader
(integrations/ggml.py, modeling_gguf_pytorch_utils.py), which is the oracle in the tests.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from tandem.engine.gguf_tokenizer import build_tokenizer, tokenizer_config
from tandem.engine.progress import Progress

# Bump when the conversion changes: cached directories of an older version are not reused.
CONVERTER_VERSION = 2

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF `<arch>.<key>` -> config.json key.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ValueError(
            "loading a .gguf checkpoint needs the `gguf` package: pip install gguf"
        ) from exc
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def _metadata(reader) -> dict[str, Any]:
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


# llama.cpp's general.file_type for the unquantized widths.
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checkpoint_dtype(meta: dict[str, Any], tensor_types: set[str]) -> str:
    """The width the converted weights keep: general.file_type's when it names one (F32, F16,
    BF16), else the matrices' (any BF16: bfloat16; all F32: float32); a quantized file's
    blocks carry fp16 scales, so float16 (half of fp32's bytes; an F16/BF16/F32 file converts
    exactly, a quantized one rounds its dequantized values once, to fp16)."""
    file_type = meta.get("general.file_type")
    if file_type in _FILE_TYPE_DTYPES:
        return _FILE_TYPE_DTYPES[file_type]
    if "BF16" in tensor_types:
        return "bfloat16"
    if tensor_types <= {"F32"}:
        return "float32"
    return "float16"


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    if (
        meta.get(f"{arch}.rope.scaling.type") not in (None, "none")
        or "rope_freqs.weight" in tensor_names
    ):
        raise ValueError(
            "GGUF checkpoints with rope scaling (rope_freqs, rope.scaling.*) are not supported"
        )
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "use_cache": True,
    }
    for key, hf_key in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in meta:
            config[hf_key] = meta[f"{arch}.{key}"]
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(
            "the GGUF file has no tokenizer (tokenizer.ggml.tokens): tandem serves text models only"
        )
    config.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    # head_dim: llama.cpp's key_length when present, else the rotary dimension (transformers reads
    # rope.dimension_count for llama), else hidden_size / heads.
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    if head_dim:
        config["head_dim"] = head_dim
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "llama":
        config.update(attention_bias="blk.0.attn_q.bias" in tensor_names, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    for name, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = meta[f"tokenizer.ggml.{key}"]
    return config


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each q/k head's two rotary halves; undo it."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _hf_tensor_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {name!r} in GGUF checkpoint")
    layer, part, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{suffix}"


def hf_tensors(reader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    progress = Progress(
        "converting GGUF tensors", len(reader.tensors), sum(int(t.n_bytes) for t in reader.tensors)
    )
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type)
        if config["model_type"] == "llama" and ".attn_q." in tensor.name:
            weight = _unpermute_rotary(weight, heads)
        elif config["model_type"] == "llama" and ".attn_k." in tensor.name:
            weight = _unpermute_rotary(weight, kv_heads)
        tensors[_hf_tensor_name(tensor.name)] = torch.from_numpy(
            np.array(weight, dtype=np.float32)
        ).to(_TORCH_DTYPES[config["torch_dtype"]])
        progress.step(int(tensor.n_bytes))
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Writes the HF-style directory for gguf_path into out_dir."""
    reader = _reader(Path(gguf_path))
    meta = _metadata(reader)
    config = hf_config(meta, {t.name for t in reader.tensors})
    matrix_types = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    config["torch_dtype"] = checkpoint_dtype(meta, matrix_types)
    tokenizer_meta = {
        k.removeprefix("tokenizer."): v for k, v in meta.items() if k.startswith("tokenizer.")
    }
    tokenizer = build_tokenizer(tokenizer_meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    save_file(hf_tensors(reader, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = tokenizer_config(tokenizer_meta, config["max_position_embeddings"])
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(
        out / "special_tokens_map.json",
        {
            k: v
            for k, v in tok_config.items()
            if k in ("bos_token", "eos_token", "unk_token", "pad_token")
        },
    )
    _write_json(
        out / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config},
    )
    return out


def gguf_cache_name(gguf_path: str | Path) -> str:
    """The cached directory's name: the file's stem and a digest of its bytes and the converter version."""
    digest = hashlib.sha256(f"tandem-gguf-v{CONVERTER_VERSION}".encode())
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return f"{Path(gguf_path).stem}-{digest.hexdigest()[:16]}"
