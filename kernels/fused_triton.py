"""Triton versions of the decoder's fused element-wise steps: same signatures as `fused.py`.

Each replaces several torch kernels with one pass over the data: RMSNorm (with the
residual add folded in), SwiGLU, and rotary embedding folded into the KV store. In a
decode step these launches, not the bytes they move, were what cost (2.4 ms of an
8 ms step at batch 32 came from ~1,200 small kernels). Intermediate results are
rounded to the activation dtype where the torch reference rounds them, so a bf16
model computes the same numbers either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_triton import INV_FP8_MAX, group_scale, to_e4m3_grid
from tandem.kernels.launch_checks import (
    FLOAT_DTYPES,
    check_index,
    check_kv_layer,
    check_tokens,
    require,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    stride_x0,
    stride_x1,
    num_inner,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,
):
    # Row r of a [R0, R1, N] view: (r // R1, r % R1); the q/k heads of a fused projection are such a view.
    row = tl.program_id(0)
    x_row = (row // num_inner).to(tl.int64) * stride_x0 + (row % num_inner).to(tl.int64) * stride_x1
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row.to(tl.int64) * n_cols + cols,
        (weight * normed).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    total_ptr,
    scale_ptr,
    stride_x,
    stride_r,
    n_cols,
    eps,
    inv_max,
    BLOCK_N: tl.constexpr,
    QUANTIZE: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """(rms_norm(residual + x), residual + x) a row per program. QUANTIZE: the normed row is not
    written in the model dtype but quantized to e4m3 with one scale a row (out_ptr float8,
    scale_ptr float32), as fp8_triton.quantize_rows quantizes the written row: bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dtype = total_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    total = (residual + x).to(dtype)
    tl.store(total_ptr + row * n_cols + cols, total, mask=mask)
    total = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(total * total, 0) / n_cols + eps)
    normed = (total * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        y = (weight * normed).to(dtype).to(tl.float32)
        scale = group_scale(tl.max(tl.abs(y), axis=0), inv_max, RECIPROCAL)
        tl.store(scale_ptr + row, scale)
        q = to_e4m3_grid(tl.math.div_rn(y, scale), 1.0)
        tl.store(out_ptr + row * n_cols + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, (weight * normed).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Rounds a float32 value to the activation dtype, as each torch op on that dtype does."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate(
    x_ptr,
    out_ptr,
    row_in,
    stride_in_head,
    row_out,
    stride_out_head,
    cos,
    sin,
    out_inv_scale,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TO_FP8: tl.constexpr,
):
    """x * cos + rotate_half(x) * sin for one token's heads, rounded like the torch reference
    (in x's dtype: each product, then their sum); TO_FP8: divided by out_scale and saturated to
    e4m3's range for an FP8 KV pool (times out_inv_scale)."""
    dtype = x_ptr.dtype.element_ty
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = x_ptr + row_in + heads * stride_in_head + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = _round(_round(x1 * cos, dtype) + _round(-x2 * sin, dtype), dtype)
    out2 = _round(_round(x2 * cos, dtype) + _round(x1 * sin, dtype), dtype)
    if TO_FP8:
        out1 = to_e4m3_grid(out1, out_inv_scale)
        out2 = to_e4m3_grid(out2, out_inv_scale)
    dst = out_ptr + row_out + heads * stride_out_head + dims
    tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    kv_ptr,
    slot_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_sin,
    stride_block,
    stride_kv,
    stride_slot,
    stride_head,
    k_inv_scale,
    v_inv_scale,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_K_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + half, mask=half < HALF, other=0.0).to(
        tl.float32
    )
    sin = tl.load(
        cos_sin_ptr + position * stride_cos_sin + HALF + half, mask=half < HALF, other=0.0
    ).to(tl.float32)
    _rotate(
        q_ptr,
        q_out_ptr,
        token * stride_qt,
        stride_qh,
        token * NUM_HEADS * 2 * HALF,
        2 * HALF,
        cos,
        sin,
        1.0,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
        HALF_PAD,
        False,
    )
    if HAS_K_OUT:  # the rotated key in the model's dtype as well, [T, Hkv, D] contiguous
        _rotate(
            k_ptr,
            k_out_ptr,
            token * stride_kt,
            stride_kh,
            token * NUM_KV_HEADS * 2 * HALF,
            2 * HALF,
            cos,
            sin,
            1.0,
            NUM_KV_HEADS,
            KV_HEADS_PAD,
            HALF,
            HALF_PAD,
            False,
        )
    slot = tl.load(slot_ptr + token).to(tl.int64)  # int32 slots: block * stride overflows int32
    if slot >= 0:
        # The rotated key goes straight to its cache slot (the layer's strides: [block, k/v, slot, head, dim]).
        dst = kv_ptr + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
        _rotate(
            k_ptr,
            dst,
            token * stride_kt,
            stride_kh,
            0,
            stride_head,
            cos,
            sin,
            k_inv_scale,
            NUM_KV_HEADS,
            KV_HEADS_PAD,
            HALF,
            HALF_PAD,
            IS_FP8,
        )
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        dims = tl.arange(0, 2 * HALF_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < 2 * HALF)
        value = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if IS_FP8:
            value = to_e4m3_grid(value, v_inv_scale)
        tl.store(
            dst + stride_kv + heads * stride_head + dims,
            value.to(kv_ptr.dtype.element_ty),
            mask=mask,
        )


def _row_block(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] or [T, H, N] (rows may be strided, e.g. heads of a fused projection) -> contiguous."""
    require(
        x.dim() in (2, 3) and x.stride(-1) == 1,
        f"x must be [T, N] or [T, H, N] with unit last stride, "
        f"got {tuple(x.shape)} strides {x.stride()}",
    )
    require(
        weight.shape == (x.shape[-1],) and weight.dtype == x.dtype and x.dtype in FLOAT_DTYPES,
        f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} {x.dtype}",
    )
    view = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = view.shape[0] * view.shape[1]
    if num_rows:
        block, warps = _row_block(x.shape[-1])
        _rms_norm_kernel[(num_rows,)](
            view,
            weight,
            out,
            view.stride(0),
            view.stride(1),
            view.shape[1],
            x.shape[-1],
            eps,
            BLOCK_N=block,
            num_warps=warps,
        )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(residual + x), residual + x); x and residual [T, N]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, _add_rms_norm(x, residual, weight, eps, out, None)


def add_rms_norm_quantize(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8_triton.quantize_rows(rms_norm(residual + x)) and residual + x in one kernel: (float8
    [T, N], float32 scales [T, 1], residual + x), bit for bit as add_rms_norm then the quantizer.
    The normed rows are never written in the model dtype (an FP8 projection reads them next)."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    return out, scale, _add_rms_norm(x, residual, weight, eps, out, scale)


def _add_rms_norm(x, residual, weight, eps, out, scale) -> torch.Tensor:
    """Runs the kernel into out (and scale when quantizing); returns residual + x."""
    require(
        x.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype,
        f"x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype} and weight "
        f"{weight.dtype} must agree",
    )
    require(
        x.stride(-1) == 1 and residual.stride(-1) == 1 and weight.shape == (x.shape[1],),
        "x and residual need unit last stride, weight one value per column",
    )
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block, warps = _row_block(x.shape[1])
        _add_rms_norm_kernel[(x.shape[0],)](
            x,
            residual,
            weight,
            out,
            total,
            total if scale is None else scale,  # (not read without QUANTIZE: any pointer)
            x.stride(0),
            residual.stride(0),
            x.shape[1],
            eps,
            INV_FP8_MAX,
            BLOCK_N=block,
            QUANTIZE=scale is not None,
            RECIPROCAL=x.is_cuda,
            num_warps=warps,
        )
    return total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up projection [T, 2I] -> [T, I]."""
    require(
        gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1,
        f"gate_up must be [T, 2I] with unit last stride, got {tuple(gate_up.shape)}",
    )
    num_tokens, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(n_cols, block))](
            gate_up, out, gate_up.stride(0), n_cols, BLOCK_N=block, num_warps=4
        )
    return out


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
    rotated query; rotated_key (contiguous [T, Hkv, D] in the key's dtype): also written the
    rotated key, unscaled."""
    check_kv_layer(kv_layer)
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    require(
        query.dim() == 3 and query.shape[-1] == head_dim and head_dim % 2 == 0,
        f"query must be [T, Hq, {head_dim}] (even head_dim), got {tuple(query.shape)}",
    )
    check_tokens("query", query, query.shape[1], head_dim, kv_layer.device)
    check_tokens("key", key, num_kv_heads, head_dim, kv_layer.device)
    check_tokens("value", value, num_kv_heads, head_dim, kv_layer.device)
    check_index("positions", positions, 1, (torch.int32, torch.int64), kv_layer.device)
    check_index("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), kv_layer.device)
    num_tokens, num_heads = query.shape[0], query.shape[1]
    require(
        key.shape[0] == value.shape[0] == positions.shape[0] == slot_mapping.shape[0] == num_tokens,
        "query, key, value, positions and slot_mapping disagree on T",
    )
    require(
        query.dtype == key.dtype
        and cos_sin.dtype == query.dtype
        and cos_sin.shape[1] == head_dim
        and cos_sin.stride(1) == 1,
        f"cos_sin must be [positions, {head_dim}] in {query.dtype}",
    )
    if rotated_key is not None:
        require(
            rotated_key.shape == key.shape
            and rotated_key.dtype == key.dtype
            and rotated_key.device == key.device
            and rotated_key.is_contiguous(),
            f"rotated_key must be a contiguous {tuple(key.shape)} {key.dtype} tensor",
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens:
        half = head_dim // 2
        _rope_store_kv_kernel[(num_tokens,)](
            query,
            key,
            value,
            positions,
            cos_sin,
            kv_layer,
            slot_mapping,
            out,
            rotated_key if rotated_key is not None else out,  # unused without HAS_K_OUT
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            cos_sin.stride(0),
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            kv_layer.stride(3),
            1.0 / kv_scales[0],
            1.0 / kv_scales[1],
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            BLOCK_SIZE=block_size,
            IS_FP8=kv_layer.dtype == torch.float8_e4m3fn,
            HAS_K_OUT=rotated_key is not None,
            num_warps=4,
        )
    return out
