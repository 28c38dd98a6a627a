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
INV_FP8_MAX = float(np.float32(1.0) / np.float32(448.0))


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
def _activation(row_ptr, offs, mask, N_COLS, SILU_MUL: tl.constexpr):
    """A row's activations at offs as float32: the row itself, or SwiGLU of a fused gate/up row
    (gate at offs, up at N_COLS + offs), rounded to the row's dtype as fused_triton's
    silu_and_mul writes it, so that its quantization is that kernel's output's, bit for bit."""
    if SILU_MUL:
        dtype = row_ptr.dtype.element_ty
        gate = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + N_COLS + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (silu * up).to(dtype).to(tl.float32)
    return tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def group_scale(amax, inv_max, RECIPROCAL: tl.constexpr):
    """A group's scale from its largest magnitude, as torch computes amax / FP8_MAX."""
    if RECIPROCAL:  # CUDA torch divides a tensor by a number as a product with its reciprocal
        return tl.maximum(amax * inv_max, 1e-12)
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)  # the CPU's divides


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x,
    GROUP,
    NUM_GROUPS,
    N_COLS,
    inv_max,
    RECIPROCAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, group): the group's largest magnitude, its scale, then the group
    divided by the scale and rounded to e4m3, with one FP8 write. A group that fits one block
    (ONE_PASS) is read once and kept in registers; a wider one is read twice. SILU_MUL: x is a
    fused gate/up projection [T, 2 * N_COLS] and the quantized activations are its SwiGLU, so
    that the [T, N_COLS] model-dtype intermediate is never written."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    src = x_ptr + row * stride_x + group * GROUP
    dst = q_ptr + row * (GROUP * NUM_GROUPS) + group * GROUP
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < GROUP
        x = _activation(src, offs, mask, N_COLS, SILU_MUL)
        scale = group_scale(tl.max(tl.abs(x), axis=0), inv_max, RECIPROCAL)
        tl.store(scale_ptr + row * NUM_GROUPS + group, scale)
        # Divided and rounded to nearest, as torch divides: a multiply by 1/scale, or the compiled
        # kernel's default approximate division, differs in the last bit (and then in the byte).
        q = to_e4m3_grid(tl.math.div_rn(x, scale), 1.0)
        tl.store(dst + offs, q.to(dst.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, GROUP, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = _activation(src, offs, offs < GROUP, N_COLS, SILU_MUL)
            amax = tl.maximum(amax, tl.abs(x))
        scale = group_scale(tl.max(amax, axis=0), inv_max, RECIPROCAL)
        tl.store(scale_ptr + row * NUM_GROUPS + group, scale)
        for k0 in range(0, GROUP, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = _activation(src, offs, offs < GROUP, N_COLS, SILU_MUL)
            q = to_e4m3_grid(tl.math.div_rn(x, scale), 1.0)
            tl.store(dst + offs, q.to(dst.dtype.element_ty), mask=offs < GROUP)


# The widest group read once (kept in registers: 32 float32 a thread at 16 warps); wider ones
# (a 70B down_proj's 28,672 columns) are read twice in blocks of TWO_PASS_BLOCK.
ONE_PASS_MAX = 16384
TWO_PASS_BLOCK = 4096


def quantize_rows(x: torch.Tensor, num_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8.py's quantize_rows in one kernel: x [T, K] -> (float8 [T, K], float32 [T, G]),
    bit for bit."""
    require(x.dim() == 2, f"quantize_rows takes [T, K], got {tuple(x.shape)}")
    return _quantize(x, x.shape[1], num_groups, silu_mul=False)


def silu_mul_quantize_rows(
    gate_up: torch.Tensor, num_groups: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(fused_triton.silu_and_mul(gate_up)) in one kernel, bit for bit: gate_up
    [T, 2I] -> (float8 [T, I], float32 [T, G]). The down projection's input is never written in
    the model dtype (at 2,048 tokens of an 8B model that is 59 MB written and read again a layer)."""
    require(
        gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
        f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}",
    )
    return _quantize(gate_up, gate_up.shape[1] // 2, num_groups, silu_mul=True)


def _quantize(
    x: torch.Tensor, cols: int, num_groups: int, silu_mul: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
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
        block = triton.next_power_of_2(group)
        one_pass = block <= ONE_PASS_MAX
        if not one_pass:
            block = TWO_PASS_BLOCK
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _quantize_rows_kernel[(rows, num_groups)](
                x,
                q,
                scale,
                x.stride(0),
                group,
                num_groups,
                cols,
                INV_FP8_MAX,
                RECIPROCAL=x.is_cuda,
                SILU_MUL=silu_mul,
                ONE_PASS=one_pass,
                BLOCK=block,
                num_warps=min(16, max(4, block // 512)),
            )
    return q, scale
