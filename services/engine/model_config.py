"""Model hyperparameters read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine.moe_config import MOE_ARCHITECTURES, MoEConfig, parse_moe

# model_type -> architecture name in config.json; the whole Llama family shares one graph.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **MOE_ARCHITECTURES,
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` + `rope_scaling`. Both describe the same thing.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return float(theta), None
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if key not in params:
            raise ValueError(f"llama3 rope scaling is missing {key!r}")
    params["rope_type"] = "llama3"
    params.pop("type", None)
    return float(theta), params


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # None: a dense model (moe_config.py)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def has_o_proj_bias(self) -> bool:
        # Qwen2 puts biases on q/k/v only; Llama's `attention_bias` covers o_proj too.
        return self.attention_bias and self.model_type not in ("qwen2", "qwen2_moe")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        expected_arch = SUPPORTED_ARCHITECTURES[model_type]
        architectures = raw.get("architectures") or [expected_arch]
        if expected_arch not in architectures:
            raise ValueError(
                f"unsupported architectures {architectures!r} for model_type {model_type!r}; "
                f"expected {expected_arch}"
            )
        hidden_size = int(_require(raw, "hidden_size"))
        num_heads = int(_require(raw, "num_attention_heads"))
        rope_theta, rope_scaling = _parse_rope(raw)
        eos = raw.get("eos_token_id")
        eos_token_ids = tuple(
            int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])
        )
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if model_type == "qwen2":
            attention_bias = True  # hard-wired in Qwen2; its config has no flag for it
        elif model_type == "qwen2_moe":
            attention_bias = bool(raw.get("qkv_bias", True))
        else:
            attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(_require(raw, "vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(_require(raw, "intermediate_size")),
            num_layers=int(_require(raw, "num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(_require(raw, "rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(_require(raw, "max_position_embeddings")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            dtype=str(dtype).removeprefix("torch."),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            moe=parse_moe(model_type, raw),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))
