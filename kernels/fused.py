"""Torch references for the decoder's fused element-wise steps: the CPU path and the Triton oracle.

Each function rounds to the activation dtype exactly where transformers' Llama does
(the Triton kernels in `fused_triton.py` copy those roundings), so a bf16 model gives
the same numbers through either path, up to the order of a float32 sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.paged_attention import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * normalise(x): float32 statistics, cast back before the weight (as HF)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one step: returns (rms_norm(residual + x), residual + x)."""
    total = residual + x
    return rms_norm(total, weight, eps), total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up projection [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(inv_freq: torch.Tensor, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_positions, head_dim]: cos of every rotary frequency in the first half, sin in the second,
    computed in float32 and cast once, as HF computes them per step."""
    freqs = (
        torch.arange(num_positions, dtype=torch.int64, device=inv_freq.device).float()[:, None]
        * inv_freq.float()
    )
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half rotation of x [T, H, D] with per-token cos/sin [T, D/2]."""
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_store_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    rotated_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates query [T, Hq, D] and key [T, Hkv, D] by their positions, writes the rotated key and
    the value to their KV slots (-1: skip; an FP8 pool: divided by kv_scales) and returns the
    rotated query; rotated_key ([T, Hkv, D]): also written the rotated key, unscaled."""
    cos, sin = cos_sin[positions.long()].chunk(2, dim=-1)
    key = _rotate(key, cos, sin)
    store_kv(key, value, kv_layer, slot_mapping, kv_scales)
    if rotated_key is not None:
        rotated_key.copy_(key)
    return _rotate(query, cos, sin)
