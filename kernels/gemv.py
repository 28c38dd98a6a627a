"""Torch references of the one-row linear kernels (gemv_triton.py), same signatures."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.fp8 import dequantize_rows
from tandem.kernels.fused import silu_and_mul


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) -> [1, N]."""
    return F.linear(x, weight, bias)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU of gate_up [1, 2K] (silu(gate) * up, each rounded to the dtype) @ weight [N, K]^T -> [1, N]."""
    return F.linear(silu_and_mul(gate_up), weight)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] @ an FP8 weight [N, K] with scales [N, G], dequantized, in float32 (+ bias) -> [1, N]
    in x's dtype: weight-only dequantization, the row unrounded."""
    out = F.linear(x.float(), dequantize_rows(weight, weight_scale)).to(x.dtype)
    return out if bias is None else out + bias


def fp8_silu_mul_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of gate_up [1, 2K] @ an FP8 weight [N, K] with scales [N, G] -> [1, N]."""
    return fp8_gemv(silu_and_mul(gate_up), weight, weight_scale)
