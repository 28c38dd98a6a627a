"""The ModelConfig of a checkpoint served through transformers' own modules (hf_model.py): what
the KV pool, the scheduler and the handoff layout need, read from transformers' config object
(whose attribute maps turn n_embd, n_head, ... into the usual names), and the checks that keep
out what tandem's paged attention would compute wrongly.

transformers is imported here only: it is not a dependency of the native path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.engine.model_config import ModelConfig


def import_transformers():
    try:
        import transformers
    except ImportError as error:
        raise ValueError(
            "the transformers model path needs the transformers package: pip install transformers"
        ) from error
    return transformers


def causal_lm_class(hf_config) -> type:
    """The transformers class that runs this config as a causal LM; ValueError naming what keeps
    it off tandem's paged attention (no causal-LM class, an encoder-decoder, cross attention, an
    attention that does not go through transformers' attention interface)."""
    transformers = import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_config.model_type
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None or getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"model_type {model_type!r} is not a decoder-only causal LM in transformers "
            f"{transformers.__version__}: tandem serves neither natively nor through transformers"
        )
    architectures = getattr(hf_config, "architectures", None) or [class_name]
    if class_name not in architectures:
        raise ValueError(
            f"architectures {architectures} of model_type {model_type!r}: the transformers path "
            f"serves {class_name} only"
        )
    if getattr(hf_config, "add_cross_attention", False):
        raise ValueError(f"{model_type} with add_cross_attention is not a decoder-only model")
    model_class = getattr(transformers, class_name)
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ValueError(
            f"{class_name} computes its attention itself (its _supports_attention_backend is not "
            f"True in transformers {transformers.__version__}): tandem cannot put its paged KV "
            f"cache under it"
        )
    return model_class


def _unsupported_attention(hf_config) -> list[str]:
    """What in the config departs from plain causal attention over every earlier token."""
    found = []
    uses_window = getattr(hf_config, "use_sliding_window", True)  # Qwen-style switch
    if getattr(hf_config, "sliding_window", None) and uses_window:
        found.append(f"sliding_window={hf_config.sliding_window}")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        found.append(f"layer_types {sorted(set(layer_types))}")
    if getattr(hf_config, "attn_logit_softcapping", None):
        found.append(f"attn_logit_softcapping={hf_config.attn_logit_softcapping}")
    is_alibi = getattr(hf_config, "position_embedding_type", None) == "alibi"
    if getattr(hf_config, "alibi", False) or is_alibi:
        found.append("ALiBi position biases")
    return found


def _dtype_name(hf_config) -> str:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return str(dtype or "float32").removeprefix("torch.")


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def transformers_model_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig(impl="transformers") of the checkpoint in model_dir, or a ValueError saying
    why transformers' implementation cannot run on tandem's paged attention."""
    transformers = import_transformers()
    hf_config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    causal_lm_class(hf_config)
    unsupported = _unsupported_attention(hf_config)
    if unsupported:
        raise ValueError(
            f"{hf_config.model_type}: the transformers path runs plain causal attention only; "
            f"this checkpoint has {', '.join(unsupported)}"
        )
    hidden_size = int(hf_config.hidden_size)
    num_heads = int(hf_config.num_attention_heads)
    return ModelConfig(
        model_type=hf_config.model_type,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(getattr(hf_config, "intermediate_size", None) or 0),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hidden_size // num_heads),
        # Norms and rotary embeddings live in transformers' modules; tandem's fields for them
        # stay neutral.
        rms_norm_eps=0.0,
        rope_theta=0.0,
        rope_scaling=None,
        max_position_embeddings=int(hf_config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=False,
        dtype=_dtype_name(hf_config),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=_token_ids(getattr(hf_config, "eos_token_id", None)),
        # What transformers' causal-LM heads do to the logits after lm_head (Cohere's logit_scale
        # multiplies, Granite-style logits_scaling divides, Gemma-style soft-caps).
        logits_scaling=float(getattr(hf_config, "logits_scaling", None) or 1.0)
        / float(getattr(hf_config, "logit_scale", None) or 1.0),
        final_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
        impl="transformers",
    )
