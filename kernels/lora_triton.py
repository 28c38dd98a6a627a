"""Triton versions of the batched LoRA shrink and expand: same signatures as `lora.py`.

Each program takes one pool slot and a tile of that slot's tokens (gathered through
LoRAMetadata.token_order), so a tile of an adapter's weights is read once for all the
tokens that use it, and tokens without an adapter launch nothing that reads memory.
The grid depends only on the number of tokens and slots, never on the mix of adapters:
a captured CUDA graph serves every mix (programs past their slot's segment return).

The shrink's reduction runs over the model width (K up to 14336) while its output has
a few dozen columns, so a decode step would get a handful of programs each walking all
of K; it is split over K instead, each split writing its own partial sums, which the
expand adds up in a fixed order: deterministic, with no atomics and no zeroing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import FLOAT_DTYPES, require
from tandem.kernels.lora import LoRAMetadata


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # Triton 3.9's interpreter multiplies bf16 operands as their raw bits: upcast there only.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")  # fp32 stays fp32 (the default would be tf32)


@triton.jit
def _segment_rows(order_ptr, starts_ptr, slot, m_tile, BLOCK_M: tl.constexpr):
    """The token rows of tile m_tile of slot's segment, their mask, and whether the tile is empty."""
    seg_start = tl.load(starts_ptr + slot)
    seg_end = tl.load(starts_ptr + slot + 1)
    offs = seg_start + m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < seg_end
    rows = tl.load(order_ptr + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask, seg_start + m_tile * BLOCK_M >= seg_end


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    order_ptr,
    starts_ptr,
    out_ptr,
    num_tokens,
    n_cols,
    k_cols,
    k_per_split,
    num_n_tiles,
    stride_x,
    stride_a_slot,
    stride_a_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    slot = tl.program_id(0)
    rows, row_mask, empty = _segment_rows(order_ptr, starts_ptr, slot, tl.program_id(1), BLOCK_M)
    if empty:
        return
    n_tile = tl.program_id(2) % num_n_tiles
    split = tl.program_id(2) // num_n_tiles
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_cols
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_cols)
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_n[None, :].to(tl.int64) * stride_a_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0
        )  # [BLOCK_K, BLOCK_N]
        acc += _dot(x, a, UPCAST)
    out = (
        out_ptr
        + split.to(tl.int64) * num_tokens * n_cols
        + rows[:, None] * n_cols
        + offs_n[None, :]
    )
    tl.store(out, acc, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    buf_ptr,
    b_ptr,
    order_ptr,
    starts_ptr,
    y_ptr,
    num_splits,
    split_stride,
    buf_cols,
    rank,
    num_n_tiles,
    stride_b_slot,
    stride_b_row,
    stride_y,
    bound0,
    bound1,
    bound2,
    bound3,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    slot = tl.program_id(0)
    rows, row_mask, empty = _segment_rows(order_ptr, starts_ptr, slot, tl.program_id(1), BLOCK_M)
    piece = tl.program_id(2) // num_n_tiles
    lo = tl.where(piece == 0, bound0, tl.where(piece == 1, bound1, bound2))
    hi = tl.where(piece == 0, bound1, tl.where(piece == 1, bound2, bound3))
    n_start = lo + (tl.program_id(2) % num_n_tiles) * BLOCK_N
    if empty | (n_start >= hi):
        return
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < rank
    # The partial sums of this slice's R columns, added in split order.
    low_rank = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    buf = buf_ptr + rows[:, None] * buf_cols + piece * rank + offs_k[None, :]
    for split in range(num_splits):
        low_rank += tl.load(
            buf + split * split_stride, mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
    b = tl.load(
        b_ptr
        + slot.to(tl.int64) * stride_b_slot
        + offs_n[None, :].to(tl.int64) * stride_b_row
        + offs_k[:, None],
        mask=n_mask[None, :] & k_mask[:, None],
        other=0.0,
    )  # [BLOCK_K, BLOCK_N]
    delta = _dot(low_rank.to(b_ptr.dtype.element_ty), b, UPCAST)
    y = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    total = tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 256 else 64


# Decided when the kernels were decorated (TRITON_INTERPRET=1 then), not at launch.
_IS_INTERPRETED = type(_lora_shrink_kernel).__name__ == "InterpretedFunction"


def _check_meta(meta: LoRAMetadata, num_slots: int, num_tokens: int, device: torch.device) -> None:
    require(
        meta.token_order.dtype == meta.slot_starts.dtype == torch.int32
        and meta.token_order.device == meta.slot_starts.device == device,
        f"LoRAMetadata tensors must be int32 on {device}",
    )
    require(
        meta.num_slots == num_slots and meta.num_tokens == num_tokens,
        f"LoRAMetadata covers {meta.num_tokens} tokens / {meta.num_slots} slots, the call "
        f"{num_tokens} / {num_slots}",
    )


def num_k_splits(num_tokens: int, k_cols: int) -> int:
    """Splits of the shrink's reduction: many when few tokens leave the grid small (decode)."""
    if num_tokens > 256:
        return max(1, min(4, k_cols // 1024))
    return max(1, min(16, k_cols // 256))


def lora_shrink(x: torch.Tensor, a_pool: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor:
    """x [T, K], a_pool [num_slots, N, K] -> partial sums [splits, T, N] float32 of x[t] @ A[slot(t)]^T."""
    require(
        x.dim() == 2 and a_pool.dim() == 3 and a_pool.shape[2] == x.shape[1],
        f"x [T, K] and a_pool [slots, N, K] disagree: {tuple(x.shape)} vs {tuple(a_pool.shape)}",
    )
    require(
        x.dtype == a_pool.dtype and x.dtype in FLOAT_DTYPES and x.device == a_pool.device,
        f"x ({x.dtype}, {x.device}) and a_pool ({a_pool.dtype}, {a_pool.device}) must share a float dtype and device",
    )
    require(x.stride(1) == 1 and a_pool.stride(2) == 1, "x and a_pool need unit stride in K")
    num_tokens, k_cols = x.shape
    num_slots, n_cols, _ = a_pool.shape
    _check_meta(meta, num_slots, num_tokens, x.device)
    splits = num_k_splits(num_tokens, k_cols)
    out = torch.empty(splits, num_tokens, n_cols, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_m, block_k = _block_m(num_tokens), 64
    block_n = max(16, min(64, triton.next_power_of_2(n_cols)))
    k_per_split = triton.cdiv(triton.cdiv(k_cols, splits), block_k) * block_k
    num_n_tiles = triton.cdiv(n_cols, block_n)
    grid = (num_slots, triton.cdiv(num_tokens, block_m), num_n_tiles * splits)
    _lora_shrink_kernel[grid](
        x,
        a_pool,
        meta.token_order,
        meta.slot_starts,
        out,
        num_tokens,
        n_cols,
        k_cols,
        k_per_split,
        num_n_tiles,
        x.stride(0),
        a_pool.stride(0),
        a_pool.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=_IS_INTERPRETED,
        num_warps=4,
    )
    return out


def lora_expand(
    buf: torch.Tensor,
    b_pool: torch.Tensor,
    meta: LoRAMetadata,
    y: torch.Tensor,
    slice_bounds: tuple[int, ...],
) -> None:
    """y[t, lo:hi] += round(buf[:, t, s*R:(s+1)*R].sum(0)) @ B[slot(t), lo:hi]^T per slice s; in place."""
    num_slices = len(slice_bounds) - 1
    require(
        1 <= num_slices <= 3
        and slice_bounds[0] == 0
        and slice_bounds[-1] == y.shape[1]
        and all(a < b for a, b in zip(slice_bounds[:-1], slice_bounds[1:])),
        f"slice_bounds {slice_bounds} must split y's {y.shape[1]} columns into 1 to 3 slices",
    )
    require(
        buf.dim() == 3
        and b_pool.dim() == 3
        and y.dim() == 2
        and b_pool.shape[1] == y.shape[1]
        and buf.shape[1] == y.shape[0]
        and buf.shape[2] == num_slices * b_pool.shape[2],
        f"buf {tuple(buf.shape)}, b_pool {tuple(b_pool.shape)} and y {tuple(y.shape)} disagree",
    )
    require(
        buf.dtype == torch.float32 and buf.is_contiguous(),
        "buf must be the shrink's contiguous float32 output",
    )
    require(
        b_pool.dtype in FLOAT_DTYPES
        and y.dtype in FLOAT_DTYPES
        and b_pool.stride(2) == 1
        and y.stride(1) == 1,
        "b_pool and y must be float with unit last stride",
    )
    require(buf.device == b_pool.device == y.device, "buf, b_pool and y must be on one device")
    num_slots, _, rank = b_pool.shape
    num_tokens = y.shape[0]
    _check_meta(meta, num_slots, num_tokens, y.device)
    if num_tokens == 0:
        return
    widest = max(b - a for a, b in zip(slice_bounds[:-1], slice_bounds[1:]))
    block_m = _block_m(num_tokens)
    block_n = max(16, min(64, triton.next_power_of_2(widest)))
    num_n_tiles = triton.cdiv(widest, block_n)
    bounds = list(slice_bounds) + [slice_bounds[-1]] * (4 - len(slice_bounds))
    grid = (num_slots, triton.cdiv(num_tokens, block_m), num_n_tiles * num_slices)
    _lora_expand_kernel[grid](
        buf,
        b_pool,
        meta.token_order,
        meta.slot_starts,
        y,
        buf.shape[0],
        num_tokens * buf.shape[2],
        buf.shape[2],
        rank,
        num_n_tiles,
        b_pool.stride(0),
        b_pool.stride(1),
        y.stride(0),
        *bounds,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=max(16, triton.next_power_of_2(rank)),
        UPCAST=_IS_INTERPRETED,
        num_warps=4,
    )
