"""Rotary tables as transformers computes them (modeling_rope_utils), one row per position.

A rope is (theta, scaling): scaling None is plain RoPE, else a dict with `rope_type` one of
ROPE_TYPES and that type's parameters, checked by parse_scaling when config.json is read.

- linear: every inverse frequency divided by `factor`;
- llama3: low frequencies divided by `factor`, high ones kept, a blend in between;
- yarn: NTK-by-parts interpolation, and cos/sin times an attention factor (mscale);
- dynamic: NTK-aware, the base grown with the sequence length past max_position_embeddings;
- longrope (Phi-3): per-frequency `short_factor`s up to original_max_position_embeddings,
  `long_factor`s past it, cos/sin times an attention factor.

transformers recomputes the dynamic and longrope frequencies per forward call from the longest
position in it, so a token's rotation there depends on the call it ran in. The KV cache keeps
rotated keys, so here a position's row is computed once, with the frequencies of a sequence that
ends at that position: a decode step rotates as transformers' does, and so does a prompt that
stays within the original length; a prompt longer than that rotates its earlier positions with
the short (original) frequencies where transformers uses the long ones for the whole prompt.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


def parse_scaling(
    params: dict[str, Any], raw: dict[str, Any], head_dim: int
) -> dict[str, Any] | None:
    """A config's rope parameters (theta removed) -> the checked scaling dict, None for plain RoPE.
    raw: the whole config.json, for fields older checkpoints keep at the top level."""
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary on all dims)")
    if rope_type == "default":
        return None
    if "original_max_position_embeddings" not in params and raw.get(
        "original_max_position_embeddings"
    ):
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    missing = [key for key in _REQUIRED[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"{rope_type} rope scaling is missing {missing[0]!r}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != head_dim // 2:
                raise ValueError(
                    f"longrope {key} has {len(params[key])} values; head_dim {head_dim} needs "
                    f"{head_dim // 2}"
                )
    return {"rope_type": rope_type, **params}


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    theta: float, dim: int, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    factor = scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _dynamic_rows(
    theta: float, dim: int, factor: float, max_positions: int, num_positions: int
) -> torch.Tensor:
    """[num_positions, dim / 2]: row p holds the NTK frequencies of a sequence of p + 1 tokens."""
    # In float32 from an integer length, as transformers' update from position ids does.
    seq_len = torch.arange(1, num_positions + 1).clamp(min=max_positions)
    base = theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base[:, None] ** exponent[None, :])


def _longrope_rows(
    theta: float, dim: int, scaling: dict[str, Any], max_positions: int, num_positions: int
) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (
        1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta**exponent)
        for key in ("short_factor", "long_factor")
    )
    is_long = torch.arange(1, num_positions + 1) > original
    return torch.where(is_long[:, None], long, short), float(attention_factor)


def rope_cos_sin_table(
    theta: float,
    scaling: dict[str, Any] | None,
    head_dim: int,
    max_positions: int,
    num_positions: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[num_positions, head_dim]: cos of each rotary frequency in the first half, sin in the second,
    times the rope's attention factor, computed in float32 and cast once (as transformers' per-step
    ones). max_positions: the config's max_position_embeddings."""
    rope_type = scaling["rope_type"] if scaling else "default"
    attention_factor = 1.0
    rows = None  # [num_positions, head_dim / 2] for the position-dependent types
    if rope_type == "dynamic":
        rows = _dynamic_rows(theta, head_dim, scaling["factor"], max_positions, num_positions)
    elif rope_type == "longrope":
        rows, attention_factor = _longrope_rows(
            theta, head_dim, scaling, max_positions, num_positions
        )
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(theta, head_dim, scaling, max_positions)
    else:
        inv_freq = _default_inv_freq(theta, head_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
    positions = torch.arange(num_positions, dtype=torch.int64, device=device).float()[:, None]
    freqs = positions * (inv_freq if rows is None else rows).to(device)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1).to(dtype)
