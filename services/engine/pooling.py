"""Sentence embeddings from token embeddings, as a sentence-transformers directory configures them.

modules.json lists the pipeline (Transformer -> Pooling -> [Normalize]); the Pooling
module's config.json picks the modes. A directory without modules.json is a plain HF
checkpoint: sentence-transformers pools those by the mean, unnormalized, and so do we.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# sentence-transformers concatenates the enabled modes in this order.
MODES = ("cls", "max", "mean", "mean_sqrt_len")


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(
                f"pooling modes must be a non-empty subset of {MODES}, got {self.modes}"
            )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PoolingConfig:
        model_dir = Path(model_dir)
        modules_path = model_dir / "modules.json"
        if not modules_path.is_file():
            return cls()
        modes: tuple[str, ...] = ("mean",)
        normalize = False
        for module in json.loads(modules_path.read_text()):
            # "sentence_transformers.models.Pooling"; the last component names the module.
            kind = module.get("type", "").rsplit(".", 1)[-1]
            if kind == "Pooling":
                modes = _read_modes(model_dir / module.get("path", "") / "config.json")
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                # A Dense or other head changes the embedding; serving without it would be silently wrong.
                raise ValueError(
                    f"{modules_path}: unsupported sentence-transformers module {module.get('type')!r}; "
                    "supported: Transformer, Pooling, Normalize"
                )
        return cls(modes, normalize)


def _read_modes(path: Path) -> tuple[str, ...]:
    if not path.is_file():
        raise ValueError(f"pooling config {path} not found (named by modules.json)")
    raw = json.loads(path.read_text())
    enabled = {
        key.removeprefix("pooling_mode_").removesuffix("_token").removesuffix("_tokens")
        for key, on in raw.items()
        if key.startswith("pooling_mode_") and on
    }
    unsupported = sorted(enabled - set(MODES))
    if unsupported:
        raise ValueError(f"{path}: unsupported pooling modes {unsupported}; supported: {MODES}")
    return tuple(m for m in MODES if m in enabled)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """hidden [batch, seq_len, dim], attention_mask [batch, seq_len] (1 = token) -> [batch, len(modes) * dim]."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    num_tokens = mask.sum(dim=1).clamp(min=1e-9)
    parts = []
    for mode in config.modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(
                hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
            )
        elif mode == "mean":
            parts.append((hidden * mask).sum(dim=1) / num_tokens)
        else:  # mean_sqrt_len
            parts.append((hidden * mask).sum(dim=1) / num_tokens.sqrt())
    pooled = torch.cat(parts, dim=-1)
    return F.normalize(pooled, p=2, dim=1) if config.normalize else pooled
