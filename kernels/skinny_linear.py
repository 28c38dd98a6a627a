"""Torch reference of the skinny linear layer (`skinny_linear_triton.py`): the CPU path and the oracle."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N]."""
    return F.linear(x, weight, bias)
