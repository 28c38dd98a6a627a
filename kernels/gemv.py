"""Torch references of the few-row linear kernels (gemv_triton.py), same signatures."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.fused import silu_and_mul

MAX_ROWS = 8  # beyond this many rows a linear layer is no longer one pass over its weight: cuBLAS


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    return F.linear(x, weight, bias)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU of gate_up [M, 2K] (silu(gate) * up, each rounded to the dtype) @ weight [N, K]^T -> [M, N]."""
    return F.linear(silu_and_mul(gate_up), weight)
