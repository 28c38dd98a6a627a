"""Model hyperparameters read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine.moe_config import MOE_ARCHITECTURES, MoEConfig, parse_moe
from tandem.engine.rope import parse_scaling

# model_type -> architecture name in config.json. One decoder graph serves them all; the fields
# below say where a family departs from Llama (norm placement, activations, scales, windows).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    **MOE_ARCHITECTURES,
}
_GEMMA = ("gemma2", "gemma3_text")
# Qwen2/Qwen3 and their MoE variants: a sliding window only with use_sliding_window.
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Which model code runs a checkpoint (EngineConfig.model_impl): "tandem" (model.py, the native
# decoder, for SUPPORTED_ARCHITECTURES), "transformers" (hf_model.py: transformers' own modules
# over tandem's paged KV cache) or "auto" (tandem's when it has the family, else transformers').
MODEL_IMPLS = ("auto", "tandem", "transformers")


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _rope_params(raw: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (theta inside; keyed by layer type for Gemma 3);
    # older checkpoints write `rope_theta` + `rope_scaling`. Both describe the same thing.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    elif layer_type is None and "full_attention" in params:
        params = params["full_attention"]
    return dict(params or {})


def _parse_rope(
    raw: dict[str, Any], head_dim: int, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    params = _rope_params(raw, layer_type)
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    return float(theta), parse_scaling(params, raw, head_dim)


def _local_rope(raw: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None] | None:
    """Gemma 3's sliding layers rotate with their own base (rope_local_base_freq, or the
    sliding_attention entry of rope_parameters), unscaled unless that entry says otherwise."""
    if raw.get("model_type") != "gemma3_text":
        return None
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return _parse_rope(raw, head_dim, "sliding_attention")
    return float(raw.get("rope_local_base_freq") or 10000.0), None


def _layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention", as transformers derives them."""
    if raw.get("layer_types"):
        types = list(raw["layer_types"])
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        return types
    model_type = raw.get("model_type")
    # Qwen3-MoE's config in transformers has no max_window_layers: every layer slides.
    if model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return ["sliding_attention"] * num_layers
    first = int(raw.get("max_window_layers") or 0)
    if model_type == "qwen2_moe":  # transformers' own rule: every other layer below the bound
        return [
            "sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
            for i in range(num_layers)
        ]
    if model_type in ("qwen2", "qwen3"):
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if model_type == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern") or 6)
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    return ["full_attention"] * num_layers


def _layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window in tokens, 0 for full attention. Qwen2/Qwen3 window only with
    use_sliding_window (their configs carry a sliding_window either way)."""
    window = raw.get("sliding_window")
    if raw.get("model_type") in _QWEN and not raw.get("use_sliding_window"):
        window = None
    if raw.get("model_type") not in ("mistral", "phi3", "mixtral", *_QWEN, *_GEMMA):
        window = None
    if not window:
        return (0,) * num_layers
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    types = _layer_types(raw, num_layers)
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def _family_fields(model_type: str, raw: dict[str, Any], hidden_size: int) -> dict[str, Any]:
    """The ModelConfig fields where model_type departs from Llama."""
    fields: dict[str, Any] = {"hidden_act": raw.get("hidden_act") or "silu"}
    if model_type in _GEMMA:
        scalar = raw.get("query_pre_attn_scalar")
        fields.update(
            norm_style="sandwich",
            norm_offset=1.0,
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
            attention_scale=float(scalar) ** -0.5 if scalar else None,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
            embedding_multiplier=hidden_size**0.5,
            embedding_multiplier_in_dtype=True,
        )
    elif model_type == "olmo2":
        fields.update(norm_style="post", qk_norm_scope="all")
    elif model_type == "granite":
        fields.update(
            attention_scale=float(raw.get("attention_multiplier", 1.0)),
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            logits_scaling=float(raw.get("logits_scaling", 1.0)),
        )
    return fields


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
    # Where a family departs from Llama; the defaults are Llama's.
    # Each layer's sliding window (0: full attention); empty: every layer full.
    layer_windows: tuple[int, ...] = ()
    # "pre": a norm before attention and before the MLP (Llama). "sandwich": those and one after
    # each, before the residual add (Gemma 2/3). "post": after each only (OLMo 2).
    norm_style: str = "pre"
    # Gemma's RMSNorm multiplies by (1 + weight).
    norm_offset: float = 0.0
    # qk_norm's scope: "head" (Qwen3, Gemma 3: each head's D) or "all" (OLMo 2: the whole q / k).
    qk_norm_scope: str = "head"
    hidden_act: str = "silu"
    # The softmax scale; None: head_dim ** -0.5.
    attention_scale: float | None = None
    # tanh soft-capping of the attention scores and of the final logits (0: none).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # The embeddings times embedding_multiplier (rounded to the model dtype first when
    # embedding_multiplier_in_dtype, as Gemma's sqrt(hidden) is); each block's output times
    # residual_multiplier before its residual add; the logits divided by logits_scaling (Granite).
    embedding_multiplier: float = 1.0
    embedding_multiplier_in_dtype: bool = False
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # The sliding layers' own rope (theta, scaling), Gemma 3; None: every layer uses the global one.
    local_rope: tuple[float, dict[str, Any] | None] | None = None
    moe: MoEConfig | None = None  # None: a dense model (moe_config.py)
    # "tandem": model.py builds the decoder from the fields above. "transformers": hf_model.py
    # runs transformers' own modules, and only the sizes, the ids and the logits' scalings here
    # are read (transformers_config.py).
    impl: str = "tandem"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(_DTYPES)}")
        if self.impl not in MODEL_IMPLS[1:]:
            raise ValueError(f"impl must be one of {MODEL_IMPLS[1:]}, got {self.impl!r}")
        if self.impl == "tandem" and self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {self.hidden_act!r}; supported: {list(_ACTIVATIONS)}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )

    def layer_window(self, index: int) -> int:
        """Layer index's sliding window in tokens, 0 for full attention."""
        return self.layer_windows[index] if self.layer_windows else 0

    @property
    def max_context_len(self) -> int:
        """The longest context the rope serves: max_position_embeddings, or as many times more as
        a linear, dynamic or YaRN scaling stretches it (vLLM's rule; llama3 and longrope
        checkpoints state the stretched length already)."""
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type")
        if rope_type == "yarn":
            return int(scaling["original_max_position_embeddings"] * scaling["factor"])
        if rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * scaling["factor"])
        return self.max_position_embeddings

    def describe_path(self) -> str:
        """One line for the logs: the family, the path it runs on and what departs from Llama."""
        if self.impl == "transformers":
            return (
                f"{self.model_type}: the transformers path, transformers' implementation on "
                f"tandem's paged attention (eager steps; no LoRA, FP8 or tensor parallelism)"
            )
        notes = []
        windows = [w for w in self.layer_windows if w]
        if windows:
            notes.append(
                f"sliding window {max(windows)} on {len(windows)} of {self.num_layers} layers"
            )
        if self.rope_scaling:
            notes.append(f"rope {self.rope_scaling['rope_type']}")
        if self.local_rope is not None:
            notes.append(f"local rope theta {self.local_rope[0]:g}")
        if self.attn_softcap or self.final_softcap:
            notes.append(f"soft-caps {self.attn_softcap:g}/{self.final_softcap:g}")
        if self.norm_style != "pre":
            notes.append(f"{self.norm_style} norms")
        if self.moe is not None:
            shared = ", a shared expert" if self.moe.has_shared_expert else ""
            notes.append(
                f"MoE: {self.moe.num_experts} experts, top-{self.moe.num_experts_per_tok} on "
                f"{len(self.moe.sparse_layers)} of {self.num_layers} layers{shared}, fused "
                f"grouped GEMM on CUDA"
            )
        detail = f" ({', '.join(notes)})" if notes else ""
        return f"{self.model_type}: tandem's native decoder, paged attention{detail}"

    @property
    def attention_scorings(self) -> tuple[tuple[int, float], ...]:
        """The distinct (window, softcap) pairs the layers' attention runs with."""
        return tuple(
            sorted({(self.layer_window(i), self.attn_softcap) for i in range(self.num_layers)})
        )

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

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
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        num_layers = int(_require(raw, "num_hidden_layers"))
        rope_theta, rope_scaling = _parse_rope(raw, head_dim)
        if raw.get("mlp_bias"):
            raise ValueError(f"{model_type} with mlp_bias is not supported")
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
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(_require(raw, "rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(_require(raw, "max_position_embeddings")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type in _GEMMA)),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2"),
            dtype=str(dtype).removeprefix("torch."),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            layer_windows=_layer_windows(raw, num_layers),
            local_rope=_local_rope(raw, head_dim),
            **_family_fields(model_type, raw, hidden_size),
            moe=parse_moe(model_type, raw),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, model_impl: str = "auto") -> ModelConfig:
        """model_impl (MODEL_IMPLS): "auto" takes tandem's decoder for the families it has and
        transformers' implementation for the others."""
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        raw = json.loads(path.read_text())
        native = raw.get("model_type") in SUPPORTED_ARCHITECTURES
        if model_impl == "transformers" or (model_impl == "auto" and not native):
            # Imported here: it imports transformers, which the native path does without.
            from tandem.engine.transformers_config import transformers_model_config

            return transformers_model_config(model_dir)
        return cls.from_dict(raw)
