"""Causal attention of fresh prompts over their own keys: a step whose every sequence starts at
position 0 (no cached prefix, no earlier chunk) attends only to the keys it computes itself.

So its keys and values are read from the step's own [T, Hkv, D] tensors rather than gathered
through the block table: the paged kernel (paged_attention_triton.py) pays 15-18% for the
gather on such steps (runs 23-24, bench/RESULTS.md). A program owns block_m query tokens of one
query head (FlashAttention-2's tiling, where the paged kernel's rows are tokens x the query heads
of one kv head), walks the key tiles left of its diagonal without masks, then the diagonal's with
the causal mask, in an online softmax in base 2. Within each (sequence, head) the query blocks
with the most keys are launched first.

Not for sliding-window or soft-capped layers, FP8 pools (whose keys the decode reads back
quantized: a prompt must see the same), the batch-invariant mode, or on a GPU shapes whose tiles
were not measured (tiled_on_gpu): dispatch.fresh_prefill says when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import require

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class FreshConfig:
    block_m: int  # query tokens per program
    block_n: int  # keys per inner step (block_m a multiple of it: the tiles left of the diagonal need no mask)
    num_warps: int
    num_stages: int


# The best of eight settings at every case swept on an H100 (bf16, head_dim 128; bench/RESULTS.md).
DEFAULT_CONFIG = FreshConfig(64, 64, 4, 3)
BLOCK_M = DEFAULT_CONFIG.block_m


def tiled_on_gpu(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether DEFAULT_CONFIG's tiles were measured for this shape on a GPU: a 2-byte dtype and a
    head_dim up to 128. Wider heads or float32 need other tiles (their shared memory outgrows
    some GPUs: float32 at head_dim 256 needs ~340 KB) and go to the paged kernel until measured."""
    return head_dim <= 128 and dtype.itemsize == 2


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    # As in paged_attention_triton._dot: under the interpreter, one float32 summation order per
    # row (numpy's matmul rounds a row by its place in the tile); tl.dot on the device.
    if INTERPRETED:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _step(
    q, k_tile, v_tile, offs_m, offs_n, m_i, l_i, acc, scale_log2, MASKED: tl.constexpr, INTERPRETED
):
    scores = _dot(q, tl.trans(k_tile), INTERPRETED) * scale_log2
    if MASKED:
        scores = tl.where(offs_n[None, :] <= offs_m[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v_tile.dtype), v_tile, INTERPRETED)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["cu_ptr"])
def _fresh_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    block = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest walks first
    seq = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    m0 = block * BLOCK_M
    if m0 < length:
        first = start.to(tl.int64)  # the sequence's first row
        kv_head = head // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        rows_ok = offs_m < length
        q = tl.load(
            q_ptr + (first + offs_m)[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=rows_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        k_base = k_ptr + first * stride_kt + kv_head * stride_kh
        v_base = v_ptr + first * stride_vt + kv_head * stride_vh
        tile = tl.arange(0, BLOCK_N)
        # Each tile's rows as pointers advanced tile by tile: 64-bit addresses throughout (a row
        # times a qkv row's stride passes 2**31 at ~150k tokens on the widest models).
        k_rows = k_base + tile[:, None] * stride_kt
        v_rows = v_base + tile[:, None] * stride_vt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        # Left of the diagonal every key is visible and inside the sequence.
        for n in range(0, m0, BLOCK_N):
            offs_n = n + tile
            k_tile = tl.load(k_rows + dims[None, :], mask=dim_ok[None, :], other=0.0)
            v_tile = tl.load(v_rows + dims[None, :], mask=dim_ok[None, :], other=0.0)
            k_rows += BLOCK_N * stride_kt
            v_rows += BLOCK_N * stride_vt
            m_i, l_i, acc = _step(
                q, k_tile, v_tile, offs_m, offs_n, m_i, l_i, acc, scale_log2, False, INTERPRETED
            )
        # The diagonal's tiles: causal, and cut at the sequence's end. Every row sees its own key,
        # padding rows (past the end) key m0 at least: no row is all -inf.
        for n in range(m0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
            offs_n = n + tile
            tile_ok = (offs_n < length)[:, None] & dim_ok[None, :]
            k_tile = tl.load(k_rows + dims[None, :], mask=tile_ok, other=0.0)
            v_tile = tl.load(v_rows + dims[None, :], mask=tile_ok, other=0.0)
            k_rows += BLOCK_N * stride_kt
            v_rows += BLOCK_N * stride_vt
            m_i, l_i, acc = _step(
                q, k_tile, v_tile, offs_m, offs_n, m_i, l_i, acc, scale_log2, True, INTERPRETED
            )
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (first + offs_m)[:, None] * stride_ot + head * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rows_ok[:, None] & dim_ok[None, :],
        )


def fresh_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    config: FreshConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's tokens over its own: query [T, Hq, D], key and
    value [T, Hkv, D] (rotated; any strides with a unit last one), query_start_loc int32 [B+1]
    (sequence b's rows, which are its positions 0..len-1), max_query_len its longest
    sequence. Returns [T, Hq, D] in the query's dtype. config: the tiles (bench/kernels.py
    --fresh-prefill sweeps them)."""
    require(
        query.dim() == key.dim() == value.dim() == 3,
        "query, key and value must be [T, H, D]",
    )
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    require(
        key.shape == value.shape == (num_tokens, num_kv_heads, head_dim),
        f"key and value must be [{num_tokens}, Hkv, {head_dim}], got {tuple(key.shape)} and "
        f"{tuple(value.shape)}",
    )
    require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"{num_heads} query heads do not group over {num_kv_heads} kv heads",
    )
    require(
        query.dtype == key.dtype == value.dtype
        and query.device == key.device == value.device
        and query.stride(2) == key.stride(2) == value.stride(2) == 1,
        "query, key and value must share dtype and device, with unit stride along the head dim",
    )
    require(
        all(x >= 16 and x & (x - 1) == 0 for x in (config.block_m, config.block_n))
        and config.block_m % config.block_n == 0,
        f"block_m and block_n must be powers of two >= 16, block_m a multiple of block_n; got "
        f"{config.block_m} and {config.block_n}",
    )
    require(
        query_start_loc.dim() == 1
        and query_start_loc.dtype == torch.int32
        and query_start_loc.device == query.device
        and query_start_loc.stride(0) == 1,
        f"query_start_loc must be a contiguous int32 [B+1] on {query.device}",
    )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0 or max_query_len <= 0:
        return out
    grid = (triton.cdiv(max_query_len, config.block_m), num_seqs, num_heads)
    _fresh_attention_kernel[grid](
        query,
        key,
        value,
        out,
        query_start_loc,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),  # tl.dot's smallest K
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        INTERPRETED=query.device.type != "cuda",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
