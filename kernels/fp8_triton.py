"""Triton helpers for FP8 (e4m3): the rounding every store to an FP8 KV pool goes through, and the
per-token (per-group) activation quantizer that feeds torch._scaled_mm on CUDA."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import FLOAT_DTYPES, require

# float32(1) / float32(448): the reciprocal CUDA torch multiplies by to divide by FP8's maximum.
_INV_FP8_MAX = float(np.float32(1.0) / np.float32(448.0))


@triton.jit
def to_e4m3_grid(x, inv_scale):
    """x * inv_scale saturated to +-448 and rounded to the nearest e4m3 value (ties to even), as
    float32: its cast to float8 is then exact. Rounded here rather than by the cast because
    Triton 3.9's interpreter drops the exponent carry when a cast rounds up to a power of two
    (127.5 -> 64); on the GPU the result is the hardware cast's."""
    # e4m3's largest magnitude, written here: a compiled kernel reads no global that is not a
    # tl.constexpr (the interpreter does, which is how a global here went unnoticed on the CPU).
    x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits down to 2^-6; below, subnormals are spaced 2^-9.
    step_exponent = tl.maximum(exponent, -6) - 3
    # Adding 1.5 * 2^(23 + step_exponent) leaves no float32 bit below the step: the add rounds.
    magic = (((step_exponent + 23 + 127) << 23).to(tl.float32, bitcast=True)) * 1.5
    rounded = (tl.abs(x) + magic) - magic
    # x's sign bit on the magnitude: a negative value that rounds to zero is -0.0, as torch's
    # cast gives (a compiled kernel negates as 0 - x, which turns +0.0 into +0.0, not -0.0).
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    GROUP,
    NUM_GROUPS,
    inv_max,
    RECIPROCAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, group): the group's largest magnitude, its scale, then the group
    divided by the scale and rounded to e4m3: two reads of the row and one FP8 write, where the
    torch path runs six kernels over float32 copies."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    src = x_ptr + row * stride_x + group * GROUP
    dst = q_ptr + row * (GROUP * NUM_GROUPS) + group * GROUP
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, GROUP, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < GROUP, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    if RECIPROCAL:  # CUDA torch divides a tensor by a number as a product with its reciprocal
        scale = tl.maximum(tl.max(amax, axis=0) * inv_max, 1e-12)
    else:  # the CPU's divides
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
    tl.store(scale_ptr + row * NUM_GROUPS + group, scale)
    for k0 in range(0, GROUP, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < GROUP, other=0.0).to(tl.float32)
        # Divided and rounded to nearest, as torch divides: a multiply by 1/scale, or the compiled
        # kernel's default approximate division, differs in the last bit (and then in the byte).
        q = to_e4m3_grid(tl.math.div_rn(x, scale), 1.0)
        tl.store(dst + offs, q.to(dst.dtype.element_ty), mask=offs < GROUP)


def quantize_rows(x: torch.Tensor, num_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8.py's quantize_rows in one kernel: x [T, K] -> (float8 [T, K], float32 [T, G]),
    bit for bit."""
    require(x.dim() == 2, f"quantize_rows takes [T, K], got {tuple(x.shape)}")
    rows, cols = x.shape
    require(
        num_groups >= 1 and cols % num_groups == 0,
        f"{cols} columns do not split into {num_groups} scale groups",
    )
    require(
        x.dtype in FLOAT_DTYPES and x.stride(1) == 1,
        f"x must be a float tensor with K-contiguous rows, got {x.dtype} strides {x.stride()}",
    )
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    group = cols // num_groups
    if rows and cols:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _quantize_rows_kernel[(rows, num_groups)](
                x,
                q,
                scale,
                x.stride(0),
                group,
                num_groups,
                _INV_FP8_MAX,
                RECIPROCAL=x.is_cuda,
                BLOCK=min(1024, triton.next_power_of_2(group)),
                num_warps=4,
            )
    return q, scale
