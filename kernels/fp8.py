"""FP8 (e4m3) GEMMs and the quantizers that feed them: the torch path on every device.

A weight is float8_e4m3fn [N, K] with float32 scales [N, G]: row n's columns in group g (K / G
columns each) are `weight * scale[n, g]`. G = 1 is one scale per output channel (per-tensor
scales are written so too); G > 1 holds a block-scaled checkpoint's 128x128 scales, repeated
per row so that fused and tensor-parallel cuts of the rows cut the scales the same way.
Activations are quantized per token (and per group when G > 1) when the GEMM runs.

The GEMM is torch._scaled_mm, which runs on the CPU (per-tensor and per-row scales, any K) and
on CUDA (sm89+, K a multiple of 16). A block-scaled weight runs one _scaled_mm per K group,
summed in float32: DeepSeek's block-scaled arithmetic, exact but G launches (a fused Triton
kernel is the GPU path still to write).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest scale: an all-zero row or token quantizes to zeros, not NaN.
_MIN_SCALE = 1e-12


def quantize_rows(weight: torch.Tensor, num_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], float32 scales [N, num_groups]), each row's group scaled so
    its largest magnitude is FP8_MAX."""
    rows, cols = weight.shape
    if cols % num_groups:
        raise ValueError(f"{cols} columns do not split into {num_groups} scale groups")
    grouped = weight.float().reshape(rows, num_groups, cols // num_groups)
    scale = (grouped.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    quantized = (grouped / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.reshape(rows, cols), scale


@dataclass(frozen=True)
class QuantizedRows:
    """Activations already quantized for an FP8 projection: float8 [T, K] with one float32 scale a
    row [T, 1] (what the norm before a projection hands it when it quantized in its own kernel:
    dispatch.add_rms_norm_fp8); dtype is the model's, the projection's output dtype."""

    xq: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def dequantize_rows(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The inverse of quantize_rows: float8 [N, K] with scales [N, G] -> dtype [N, K]."""
    rows, cols = weight.shape
    grouped = weight.float().reshape(rows, scale.shape[1], cols // scale.shape[1])
    return (grouped * scale.float()[..., None]).reshape(rows, cols).to(dtype)


def _row_scaled_mm(a, b, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with per-row (a) and per-column (b) scales. A CPU build before torch 2.13
    takes per-tensor scales only there: the same product through float32 operands instead.
    On CUDA with fast accumulation (the tensor cores' partial sums are not promoted to float32
    along K), as vLLM's SM90 CUTLASS FP8 GEMMs run: ~10% faster at the 8B layer's
    prefill shapes on an H100 (bench/prefill_profile.py --quantization fp8)."""
    try:
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=a.is_cuda
        )
    except RuntimeError as exc:
        if a.is_cuda or "per-tensor" not in str(exc):
            raise
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize=quantize_rows,
) -> torch.Tensor:
    """x [T, K] (model dtype) @ dequantized weight [N, K]^T (+ bias) -> [T, N] in x's dtype, with x
    quantized per token on the fly (dynamic activation scales) by `quantize` (quantize_rows, or
    fp8_triton's one-kernel version of it on CUDA)."""
    if x.shape[0] == 0:
        return x.new_zeros((0, weight.shape[0]))
    xq, x_scale = quantize(x, weight_scale.shape[1])
    return fp8_linear_quantized(xq, x_scale, weight, weight_scale, x.dtype, bias)


def fp8_linear_quantized(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_linear's product of activations already quantized: xq float8 [T, K] with scales [T, G]
    (G = weight_scale's groups) -> [T, N] in dtype."""
    num_tokens, cols = xq.shape
    if num_tokens == 0:
        return torch.zeros(0, weight.shape[0], dtype=dtype, device=xq.device)
    num_groups = weight_scale.shape[1]
    # CUDA's row-wise scaled GEMM writes bfloat16 only; the CPU writes any float dtype.
    out_dtype = torch.bfloat16 if xq.is_cuda else dtype
    if num_groups == 1:
        out = _row_scaled_mm(xq, weight.t(), x_scale, weight_scale.view(1, -1), out_dtype)
    else:
        group = cols // num_groups
        out = torch.zeros(num_tokens, weight.shape[0], dtype=torch.float32, device=xq.device)
        for g in range(num_groups):
            columns = slice(g * group, (g + 1) * group)
            # CUDA writes a row-wise scaled product in bfloat16 only: each group's is rounded
            # there, and the groups add up in float32.
            out += _row_scaled_mm(
                xq[:, columns],
                weight[:, columns].t(),
                x_scale[:, g : g + 1].contiguous(),
                weight_scale[:, g].reshape(1, -1).contiguous(),
                out_dtype,
            ).float()
    out = out.to(dtype)
    return out if bias is None else out + bias


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same product through dequantized float32 operands (no activation rounding): the oracle
    fp8_linear is tested and benchmarked against."""
    out = x.float() @ dequantize_rows(weight, weight_scale).t()
    out = out.to(x.dtype)
    return out if bias is None else out + bias
