"""The engine's one configuration object, validated at construction."""
from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    # Tokens per KV block; the unit of allocation, prefix caching and transfer.
    block_size: int = 16
    # Blocks in the KV pool; 0 means "size from kv_cache_memory_gb".
    num_blocks: int = 0
    kv_cache_memory_gb: float = 0.25
    # Continuous batching limits: sequences per step and tokens per step (the
    # chunked-prefill budget).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # 0 means the model's max_position_embeddings.
    max_model_len: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    # Prefill side of a handoff: seconds a handed-off request's KV stays leased if the
    # decode side never says it has pulled it.
    kv_lease_seconds: float = 30.0
    # Reuse the KV of full blocks whose token prefix (and cache_salt) was seen before.
    enable_prefix_caching: bool = True
    # Run decode steps eagerly instead of replaying CUDA graphs of padded batch sizes.
    enforce_eager: bool = False
    # Schedule and post-process on the host while the previous step runs on the device.
    overlap_scheduling: bool = True

    def __post_init__(self):
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir!r} has no config.json: give a Hugging Face checkpoint directory")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_blocks < 0 or self.max_model_len < 0:
            raise ValueError("num_blocks and max_model_len must be >= 0 (0 means automatic)")
        if self.num_blocks == 0 and self.kv_cache_memory_gb <= 0:
            raise ValueError("give num_blocks > 0 or kv_cache_memory_gb > 0 to size the KV cache")
        if self.kv_lease_seconds <= 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {self.kv_lease_seconds}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
