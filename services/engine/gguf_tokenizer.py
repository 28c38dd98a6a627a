"""The tokenizer stored in a GGUF file's metadata, rebuilt as a `tokenizers` tokenizer.json.

It is built the way transformers builds it from the same metadata (its GGUF Llama converter),
so tandem and transformers encode and decode a GGUF model's text identically. Only the
byte-level BPE vocabulary (`tokenizer.ggml.model == "gpt2"`: Llama 3, SmolLM, Qwen) is
supported; SentencePiece vocabularies (`"llama"`) are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

# GGUF token types (gguf.TokenType): CONTROL tokens are the special ones.
_CONTROL = 3
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


def _token(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """meta: the GGUF fields under `tokenizer.` (e.g. "ggml.tokens"), as plain Python values."""
    model = meta.get("ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r}; supported: {list(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens: list[str] = meta["ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta.get("ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF tokenizer merges must each be two space-separated symbols")
    tokenizer = Tokenizer(
        BPE(
            {t: i for i, t in enumerate(tokens)},
            merges,
            unk_token=_token(tokens, meta.get("ggml.unknown_token_id")),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    token_types = meta.get("ggml.token_type") or []
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], normalized=False, special=True)
            for i, kind in enumerate(token_types)
            if kind == _CONTROL
        ]
    )
    tokenizer.normalizer = normalizers.Sequence([])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=True
    )
    steps = [
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Replace("\u2581", " "),
        decoders.ByteLevel(),
    ]
    if meta.get("ggml.add_space_prefix", False):
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    bos = _token(tokens, meta.get("ggml.bos_token_id"))
    if meta.get("ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return tokenizer


def tokenizer_config(meta: dict[str, Any], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name and the chat template, as transformers reads them."""
    tokens: list[str] = meta["ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for name, key in (
        ("bos_token", "ggml.bos_token_id"),
        ("eos_token", "ggml.eos_token_id"),
        ("unk_token", "ggml.unknown_token_id"),
        ("pad_token", "ggml.padding_token_id"),
    ):
        token = _token(tokens, meta.get(key))
        if token is not None:
            config[name] = token
    if meta.get("chat_template"):
        config["chat_template"] = meta["chat_template"]
    return config
