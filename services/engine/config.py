"""The engine's one configuration object, validated at construction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tandem.common.flag_fields import flag_field
from tandem.engine.model_config import MODEL_IMPLS
from tandem.engine.speculative import SpeculativeConfig

# Draft rows a step samples at most (speculative decoding): each is a row of the vocabulary in
# the sampler's work, [rows, vocab] in float32 several times over.
MAX_DRAFT_ROWS = 1024


# A field that is also a command-line flag of every engine-running command (tandem serve,
# tandem up): services/cli/flags.py builds the flags from this metadata, the one definition.
_flag = flag_field


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_dir: str = _flag(
        None,
        "Hugging Face checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)",
        flag="--model",
    )
    block_size: int = _flag(
        16, "tokens per KV block: the unit of allocation, prefix caching and transfer"
    )
    num_blocks: int = _flag(0, "KV blocks in the pool (0: size it from --kv-cache-gb)")
    kv_cache_memory_gb: float = _flag(
        0.25, "memory for the KV pool when --num-blocks is 0", flag="--kv-cache-gb"
    )
    host_kv_cache_gb: float = _flag(
        0.0,
        "host memory for a second KV tier below the pool (pinned on a GPU): prefix blocks the "
        "pool evicts are copied down and copied back up on a later prefix hit (0: none; needs "
        "prefix caching; one rank only)",
        flag="--host-kv-cache-gb",
    )
    # Continuous batching limits: sequences per step and tokens per step (the chunked-prefill budget).
    max_num_seqs: int = _flag(64, "sequences per engine step")
    max_num_batched_tokens: int = _flag(2048, "token budget per step (chunked prefill)")
    max_model_len: int = _flag(0, "context length (0: the model's max_position_embeddings)")
    dtype: str = _flag(
        "auto", "weights and KV dtype", choices=["auto", "float32", "float16", "bfloat16"]
    )
    quantization: str = _flag(
        "auto",
        "weights: auto (as the checkpoint stores them: FP8 checkpoints load as FP8) or fp8 (a "
        "bf16/fp16/fp32 checkpoint's projections quantized to FP8 e4m3 at load, one scale per "
        "output channel, activations quantized per token)",
        choices=["auto", "fp8"],
    )
    kv_cache_dtype: str = _flag(
        "auto",
        "KV pool dtype: auto (the model dtype) or fp8 (float8_e4m3fn with a per-layer scale, "
        "the checkpoint's k_scale/v_scale or 1.0: twice the blocks of bf16 in the same memory)",
        choices=["auto", "fp8"],
    )
    model_impl: str = _flag(
        "auto",
        "the model code: tandem (the native decoder, for the families it has), transformers "
        "(transformers' own modules over tandem's paged KV cache: any decoder-only model whose "
        "attention goes through transformers' attention interface; no LoRA, FP8, tensor "
        "parallelism, CUDA graphs, --deterministic or draft model) or auto (tandem's when it has "
        "the model_type, else transformers')",
        choices=list(MODEL_IMPLS),
    )
    device: str = _flag("cpu", "cpu, cuda or cuda:N")
    seed: int = _flag(0, "seed of unseeded sampling")
    kv_lease_seconds: float = _flag(
        30.0, "prefill: seconds a handed-off KV stays pinned waiting for the decode side"
    )
    enable_prefix_caching: bool = _flag(
        True, "do not reuse the KV of prompt prefixes seen before", flag="--no-prefix-caching"
    )
    enforce_eager: bool = _flag(
        False, "run decode steps eagerly instead of replaying CUDA graphs of padded batch sizes"
    )
    max_loras: int = _flag(
        4,
        "LoRA adapters held on the device at once (the adapter pool's slots; a batch mixes "
        "at most this many; 0: refuse lora_request)",
    )
    max_lora_rank: int = _flag(
        16, "largest LoRA rank the adapter pool holds (lower ranks are zero-padded to it)"
    )
    tensor_parallel_size: int = _flag(
        1,
        "ranks (GPUs) the worker spans: one process each, the model's heads, "
        "intermediate size and vocabulary split across them",
    )
    overlap_scheduling: bool = _flag(
        True,
        "read each step's tokens back before scheduling the next (no overlap of "
        "host and device work)",
        flag="--no-overlap-scheduling",
    )
    deterministic: bool = _flag(
        False,
        "batch-invariant numerics: a request's tokens, logprobs and logits are bitwise the same "
        "whatever it is batched with, however its prompt is chunked, aggregated or split "
        "(greedy and seeded sampling; fixed-shape GEMM tiles and a fixed attention schedule; "
        "LoRA requests refused)",
    )

    speculative_config: str = _flag(
        "",
        "speculative decoding, vLLM's JSON shape: "
        '\'{"method": "ngram"|"suffix", "num_speculative_tokens": K, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}\' or \'{"method": "draft_model"|"eagle3", "model": DIR, '
        '"num_speculative_tokens": K}\' (drafts verified in one forward; greedy and seeded outputs '
        "unchanged); empty: none",
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def max_num_samples(self) -> int:
        """Rows a step samples at most: one per sequence, and its drafts' (speculative decoding),
        at most MAX_DRAFT_ROWS of those a step: the sampler's [rows, vocab] work grows with them."""
        spec = self.speculative
        if spec is None:
            return self.max_num_seqs
        drafts = self.max_num_seqs * spec.num_speculative_tokens
        return self.max_num_seqs + min(drafts, MAX_DRAFT_ROWS, self.max_num_batched_tokens)

    def __post_init__(self):
        if not self.model_dir or not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(
                f"model_dir {self.model_dir!r} has no config.json: give a Hugging Face checkpoint directory"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError("num_blocks and max_model_len must be >= 0 (0 means automatic)")
        if self.num_blocks == 0 and self.kv_cache_memory_gb <= 0:
            raise ValueError("give num_blocks > 0 or kv_cache_memory_gb > 0 to size the KV cache")
        if not 0 <= self.host_kv_cache_gb <= 4096:
            raise ValueError(
                f"host_kv_cache_gb must be in [0, 4096] GiB, got {self.host_kv_cache_gb}"
            )
        if self.host_kv_cache_gb and not self.enable_prefix_caching:
            raise ValueError(
                "--host-kv-cache-gb keeps evicted prefix blocks: it needs prefix caching (drop "
                "--no-prefix-caching or the host tier)"
            )
        if self.host_kv_cache_gb and self.tensor_parallel_size > 1:
            raise ValueError(
                "--host-kv-cache-gb is not supported with tensor_parallel_size > 1 yet (each rank's "
                "pool would need its own tier): give one or the other"
            )
        if self.kv_lease_seconds <= 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {self.kv_lease_seconds}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras must be >= 0 and max_lora_rank >= 1, got {self.max_loras} and "
                f"{self.max_lora_rank}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.max_loras:
            raise ValueError(
                f"LoRA adapters are not supported with tensor_parallel_size > 1 (the adapter pool "
                f"is not sharded): give --max-loras 0 with --tensor-parallel-size "
                f"{self.tensor_parallel_size}"
            )
        spec = self.speculative  # parsed here: a bad --speculative-config fails at start
        if spec is not None and spec.method == "eagle3" and self.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-config: method 'eagle3' runs on a single-rank target for now (the "
                f"head reads the target's layers on one rank): give --tensor-parallel-size 1 "
                f"(not {self.tensor_parallel_size}) or another method"
            )
        for name in ("quantization", "kv_cache_dtype"):
            if getattr(self, name) not in ("auto", "fp8"):
                raise ValueError(f"{name} must be auto or fp8, got {getattr(self, name)!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
