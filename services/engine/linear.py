"""The decoder's projections: nn.Linear in the model dtype, or Fp8Linear (FP8 weights, float32
scales; kernels/fp8.py) when the checkpoint is FP8 or --quantization fp8 asks for it."""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import dispatch as kernels
from tandem.kernels.fp8 import FP8, QuantizedRows, fp8_linear_quantized


class Fp8Linear(nn.Module):
    """weight [out, in] float8_e4m3fn and weight_scale [out, num_groups] float32 (quant_formats.py
    normalizes every FP8 checkpoint format to this layout); the bias stays in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, num_groups: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), False)
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, num_groups, dtype=torch.float32), False
        )
        self.bias = nn.Parameter(torch.empty(out_features), False) if bias else None


def build_linear(
    in_features: int, out_features: int, bias: bool, fp8_group_size: int | None
) -> nn.Module:
    """fp8_group_size: None for model-dtype weights; 0 for one FP8 scale per output row; else the
    input columns that share a scale (a block-scaled checkpoint's block width)."""
    if fp8_group_size is None:
        return nn.Linear(in_features, out_features, bias=bias)
    if fp8_group_size and in_features % fp8_group_size:
        raise ValueError(
            f"a projection of {in_features} input features does not split into FP8 scale blocks "
            f"of {fp8_group_size} columns (under tensor parallelism: choose a size that keeps "
            f"each rank's share a multiple of {fp8_group_size})"
        )
    num_groups = in_features // fp8_group_size if fp8_group_size else 1
    return Fp8Linear(in_features, out_features, bias, num_groups)


def apply_linear(module: nn.Module, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """x: model-dtype rows, or rows the norm before an Fp8Linear quantized for it (fp8_input)."""
    if isinstance(x, QuantizedRows):
        if not isinstance(module, Fp8Linear) or module.weight_scale.shape[1] != x.scale.shape[1]:
            raise TypeError(
                f"rows quantized with {x.scale.shape[1]} scale(s) a row reached "
                f"{type(module).__name__}: only the Fp8Linear fp8_input chose may read them"
            )
        return fp8_linear_quantized(
            x.xq, x.scale, module.weight, module.weight_scale, x.dtype, module.bias
        )
    if isinstance(module, Fp8Linear):
        return kernels.fp8_linear(x, module.weight, module.weight_scale, module.bias)
    return kernels.linear(x, module.weight, module.bias)


def fp8_input(module: nn.Module, lora) -> Fp8Linear | None:
    """The projection a norm may quantize its output for (RMSNorm's fp8_for): an Fp8Linear with
    one scale a row, and no LoRA adapters in the step (they read the model-dtype rows)."""
    if lora is None and isinstance(module, Fp8Linear) and module.weight_scale.shape[1] == 1:
        return module
    return None


def apply_silu_mul_linear(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up) through module (the fused SwiGLU GEMV for model-dtype weights)."""
    if isinstance(module, Fp8Linear):
        return kernels.fp8_silu_mul_linear(gate_up, module.weight, module.weight_scale)
    return kernels.silu_mul_linear(gate_up, module.weight)
