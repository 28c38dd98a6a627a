"""Torch references of the one-row linear kernels (gemv_triton.py), same signatures."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.fused import silu_and_mul


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) -> [1, N]."""
    return F.linear(x, weight, bias)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU of gate_up [1, 2K] (silu(gate) * up, each rounded to the dtype) @ weight [N, K]^T -> [1, N]."""
    return F.linear(silu_and_mul(gate_up), weight)
