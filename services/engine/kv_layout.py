"""What a worker's KV blocks look like, and the hash two workers compare before a handoff."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tandem.engine.model_config import ModelConfig


def kv_layout(
    model_dir: str,
    config: ModelConfig,
    dtype_name: str,
    block_size: int,
    quantization: str = "auto",
    deterministic: bool = False,
    deterministic_schedule: str = "",
) -> dict:
    """The fields that must agree for one worker's KV blocks to be usable by another. The model's
    config.json digest stands for "the same model": same shapes with other weights would be wrong KV
    (so does quantization: FP8 weights quantized at load compute other KV than the checkpoint's).
    dtype_name is the KV pool's dtype: an FP8 pool's bytes mean nothing to a bf16 one.
    deterministic: KV computed with batch-dependent numerics would make a --deterministic decode
    continue differently from its aggregated run, silently: the two modes do not hand off; nor do
    two deterministic workers whose batch-invariant schedules differ (deterministic_schedule,
    batch_invariant.schedule_id: a CPU's and a GPU's compute other bits)."""
    config_digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]
    return {
        "model_config_sha256": config_digest,
        "model_type": config.model_type,
        "num_layers": config.num_layers,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "dtype": dtype_name,
        "block_size": block_size,
        "quantization": quantization,
        "deterministic": deterministic,
        "deterministic_schedule": deterministic_schedule if deterministic else "",
    }


def layout_hash(layout: dict) -> str:
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:32]
