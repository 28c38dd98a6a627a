"""Triton helpers for FP8 (e4m3) KV blocks: the rounding every store to an FP8 pool goes through."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_e4m3_grid(x, inv_scale):
    """x * inv_scale saturated to +-448 and rounded to the nearest e4m3 value (ties to even), as
    float32: its cast to float8 is then exact. Rounded here rather than by the cast because
    Triton 3.9's interpreter drops the exponent carry when a cast rounds up to a power of two
    (127.5 -> 64); on the GPU the result is the hardware cast's."""
    # e4m3's largest magnitude, written here: a compiled kernel reads no global that is not a
    # tl.constexpr (the interpreter does, which is how a global here went unnoticed on the CPU).
    x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits down to 2^-6; below, subnormals are spaced 2^-9.
    step_exponent = tl.maximum(exponent, -6) - 3
    # Adding 1.5 * 2^(23 + step_exponent) leaves no float32 bit below the step: the add rounds.
    magic = (((step_exponent + 23 + 127) << 23).to(tl.float32, bitcast=True)) * 1.5
    rounded = (tl.abs(x) + magic) - magic
    return tl.where(x < 0, -rounded, rounded)  # -0.0 stays -0.0, as torch's cast keeps it
