"""Triton paged KV store and paged attention: same signatures as `paged_attention.py`.

One attention kernel serves a whole mixed batch (prefill chunks and decode rows). A
program owns (sequence, query block, kv head, kv split): its rows are BLOCK_Q query
tokens x the GROUP query heads that share the kv head, so each K/V tile is read once
for the whole group (GQA) and the row count is large enough for tensor-core dots even
when a sequence brings one token. Keys are walked in tiles of TILE_N tokens gathered
through the block table, with an online softmax in base 2.

When the grid is too small to fill the GPU (few decode sequences over long contexts),
the keys are split into segments handled by separate programs (flash-decoding) and a
second kernel merges their partial outputs by log-sum-exp.

A sliding-window layer (HAS_WINDOW) starts each program's walk at the tile holding its first
row's oldest visible key and masks the tiles at the window's edge; soft-capping (HAS_SOFTCAP)
squashes the scaled scores by softcap * tanh(score / softcap) before the softmax, as the torch
reference does.

An FP8 pool (IS_FP8) stores key / k_scale and value / v_scale, saturated to e4m3's range, and
the attention reads each tile back times its scale in the query's dtype, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8_triton import to_e4m3_grid
from tandem.kernels.launch_checks import check_index, check_kv_layer, check_tokens, require

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    # Under Triton's interpreter (CPU tests) tl.dot is numpy's matmul, whose BLAS kernels round
    # a row by where it sits in the tile (FMA edge kernels), and which multiplies bf16 operands
    # as their raw bits (Triton 3.9): there the product is summed in float32 in one order for
    # every row, so a row's bits do not depend on the rows beside it, as on the device.
    if INTERPRETED:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,
    stride_kv,
    stride_slot,
    stride_head,
    k_inv_scale,
    v_inv_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)  # int32 slots: block * stride overflows int32
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    row = token.to(tl.int64)
    key = tl.load(key_ptr + row * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + row * stride_vt + heads * stride_vh + dims, mask=mask)
    if IS_FP8:
        key = to_e4m3_grid(key, k_inv_scale)
        value = to_e4m3_grid(value, v_inv_scale)
    dst = (
        kv_ptr
        + (slot // BLOCK_SIZE) * stride_block
        + (slot % BLOCK_SIZE) * stride_slot
        + heads * stride_head
        + dims
    )
    tl.store(dst, key.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _soft_cap(x, cap):
    """cap * tanh(x / cap), tanh from one exp2 of a non-positive argument (no overflow)."""
    t = tl.exp2(-2.0 * _LOG2E * tl.abs(x / cap))
    tanh = (1.0 - t) / (1.0 + t)
    return cap * tl.where(x < 0, -tanh, tanh)


@triton.jit
def _attend_tile(
    q,
    kv_ptr,
    table,
    start,
    kv_hi,
    q_pos,
    head_off,
    dims,
    dim_valid,
    m_i,
    l_i,
    acc,
    scale_log2,
    stride_block,
    stride_kv,
    stride_slot,
    k_scale,
    v_scale,
    window,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys [start, start + TILE_N), gathered through the block table."""
    pos = start + tl.arange(0, TILE_N)
    pos_valid = pos < kv_hi
    block_id = tl.load(table + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
    kv_offs = block_id * stride_block + (pos % BLOCK_SIZE) * stride_slot + head_off
    tile_mask = pos_valid[:, None] & dim_valid[None, :]
    k = tl.load(kv_ptr + kv_offs[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    v = tl.load(kv_ptr + stride_kv + kv_offs[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    if IS_FP8:
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    scores = _dot(q, tl.trans(k), INTERPRETED_DOT) * scale_log2
    if HAS_SOFTCAP:
        scores = _soft_cap(scores * (1.0 / _LOG2E), softcap) * _LOG2E
    if MASKED:
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, INTERPRETED_DOT)
    return m_new, l_i, acc


# The index tensors are views at any offset into the step's packed buffers and the table's width
# is the pool's: their alignment must not pick a kernel variant (each variant compiles for ~1 s).
@triton.jit(
    do_not_specialize=["block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "stride_table"]
)
def _attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_kv,
    stride_slot,
    stride_head,
    stride_table,
    k_scale,
    v_scale,
    window,
    softcap,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,
    IS_FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_index = q_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_index < query_len) & (rows % GROUP_PAD < GROUP)
    # Row r may see keys at positions <= its own absolute position (causal).
    q_pos = context_len + q_index
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q_offs = (
        (query_start + q_index).to(tl.int64)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :]
    )
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    # Each sequence cuts its own keys into NUM_SPLITS tile-aligned segments: the launch depends
    # on no host-side length, so one captured CUDA graph serves every context length.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    # A finite floor keeps fully masked rows at exp2(-inf - floor) = 0 instead of NaN.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    head_off = kv_head * stride_head
    # Tiles wholly below the block's first row's diagonal need no mask; only the rest pay for it.
    first_pos = context_len + q_block * BLOCK_Q
    num_unmasked = tl.maximum(tl.minimum(kv_hi, first_pos + 1) - kv_lo, 0) // TILE_N
    unmasked_hi = kv_lo + num_unmasked * TILE_N
    # Tiles are aligned to kv_lo: [walk_lo, full_lo) masked (a window's edge), [full_lo, full_hi)
    # visible to every row, [full_hi, kv_hi) masked (the diagonal, the end).
    walk_lo = kv_lo
    full_lo = kv_lo
    if HAS_WINDOW:
        # The first row's oldest visible key, and the last row's: tiles below the first are
        # skipped, tiles below the second are masked.
        last_pos = tl.minimum(kv_end, seq_len) - 1
        walk_lo = kv_lo + (tl.maximum(first_pos - window + 1 - kv_lo, 0) // TILE_N) * TILE_N
        full_lo = kv_lo + tl.cdiv(tl.maximum(last_pos - window + 1 - kv_lo, 0), TILE_N) * TILE_N
        full_lo = tl.minimum(tl.maximum(full_lo, walk_lo), tl.maximum(unmasked_hi, walk_lo))
    full_hi = tl.maximum(unmasked_hi, full_lo)
    for start in range(walk_lo, full_lo, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q,
            kv_ptr,
            table,
            start,
            kv_hi,
            q_pos,
            head_off,
            dims,
            dim_valid,
            m_i,
            l_i,
            acc,
            scale_log2,
            stride_block,
            stride_kv,
            stride_slot,
            k_scale,
            v_scale,
            window,
            softcap,
            BLOCK_SIZE,
            TILE_N,
            True,
            INTERPRETED_DOT,
            IS_FP8,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    for start in range(full_lo, full_hi, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q,
            kv_ptr,
            table,
            start,
            kv_hi,
            q_pos,
            head_off,
            dims,
            dim_valid,
            m_i,
            l_i,
            acc,
            scale_log2,
            stride_block,
            stride_kv,
            stride_slot,
            k_scale,
            v_scale,
            window,
            softcap,
            BLOCK_SIZE,
            TILE_N,
            False,
            INTERPRETED_DOT,
            IS_FP8,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )
    for start in range(full_hi, kv_hi, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q,
            kv_ptr,
            table,
            start,
            kv_hi,
            q_pos,
            head_off,
            dims,
            dim_valid,
            m_i,
            l_i,
            acc,
            scale_log2,
            stride_block,
            stride_kv,
            stride_slot,
            k_scale,
            v_scale,
            window,
            softcap,
            BLOCK_SIZE,
            TILE_N,
            True,
            INTERPRETED_DOT,
            IS_FP8,
            HAS_WINDOW,
            HAS_SOFTCAP,
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    token = (query_start + q_index).to(tl.int64)
    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are contiguous: out [T, Hq, NUM_SPLITS, DIM_PAD], lse [T, Hq, NUM_SPLITS].
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * DIM_PAD + dims[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    base = (token * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    # Split 0 always holds key 0, so the max is finite and the weights sum to >= 1.
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(
        part_out_ptr + (base + splits)[:, None] * DIM_PAD + dims[None, :],
        mask=(splits < NUM_SPLITS)[:, None],
        other=0.0,
    )
    out = tl.sum(tl.where(weight[:, None] > 0, part * weight[:, None], 0.0), 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# Decided when the kernels were decorated (TRITON_INTERPRET=1 then), not at launch.
_IS_INTERPRETED = type(_attention_kernel).__name__ == "InterpretedFunction"


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Writes token i's key/value [T, Hkv, D] to slot `slot_mapping[i]` (-1: skip)."""
    check_kv_layer(kv_layer)
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    check_tokens("key", key, num_kv_heads, head_dim, kv_layer.device)
    check_tokens("value", value, num_kv_heads, head_dim, kv_layer.device)
    check_index("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), kv_layer.device)
    num_tokens = key.shape[0]
    require(
        value.shape[0] == num_tokens == slot_mapping.shape[0],
        f"key, value and slot_mapping disagree on T: {key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}",
    )
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_layer,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        IS_FP8=kv_layer.dtype == torch.float8_e4m3fn,
    )


@dataclass(frozen=True)
class LaunchConfig:
    rows: int  # query rows per program: tokens x GQA group
    tile_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def launch_config(has_prefill: bool, dim_pad: int) -> LaunchConfig:
    """Tile sizes per step kind. A decode-only step has one token per sequence, so it
    takes only the 16 rows tl.dot requires, mostly filled by the GQA group."""
    if has_prefill:
        return LaunchConfig(64, 64 if dim_pad <= 128 else 32, 4, 2)
    return LaunchConfig(16, 64 if dim_pad <= 128 else 32, 4, 2)


def _default_num_splits(
    num_programs: int, max_seq_len: int, tile_n: int, device: torch.device
) -> int:
    """Enough key segments to give every SM about two programs, each segment >= 4 tiles."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if num_programs >= num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(wanted, triton.cdiv(max_seq_len, 4 * tile_n), 32))


def graph_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key segments per sequence for a captured decode step of num_seqs sequences: about two
    programs per SM whatever the context length, which a graph cannot know in advance (a
    sequence's segments past its context are empty and cost one early exit each)."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(32, triton.next_power_of_2(triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)))


def paged_attention_triton(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int = 0,
    softcap: float = 0.0,
    *,
    num_kv_splits: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its whole paged KV.

    query [T, Hq, D] -> [T, Hq, D]. The new tokens' KV must already be stored. window > 0: each
    query sees its last `window` keys only; softcap > 0: scores capped (paged_attention.py).
    `num_kv_splits` overrides the key-segment count (tests); else `meta.num_kv_splits` (fixed per
    captured CUDA graph), else one is picked per grid size and context length.
    batch_invariant (--deterministic): one launch configuration for every step (the decode one)
    and one key segment, so a row's keys are walked in the same tiles and order whatever the
    step holds (tiles past a row's position are masked for it and leave it exactly as it was).
    """
    check_kv_layer(kv_layer)
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    require(query.dim() == 3, f"query must be [T, Hq, D], got {tuple(query.shape)}")
    num_heads = query.shape[1]
    check_tokens("query", query, num_heads, head_dim, kv_layer.device)
    require(
        num_heads % num_kv_heads == 0,
        f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads",
    )
    is_fp8 = kv_layer.dtype == torch.float8_e4m3fn
    require(
        query.dtype == kv_layer.dtype or is_fp8,
        f"query dtype {query.dtype} differs from kv_layer dtype {kv_layer.dtype}",
    )
    check_index("meta.query_start_loc", meta.query_start_loc, 1, (torch.int32,), kv_layer.device)
    check_index("meta.seq_lens", meta.seq_lens, 1, (torch.int32,), kv_layer.device)
    check_index("meta.block_tables", meta.block_tables, 2, (torch.int32,), kv_layer.device)
    num_seqs = meta.num_seqs
    require(
        meta.query_start_loc.shape[0] == num_seqs + 1 and meta.block_tables.shape[0] == num_seqs,
        f"metadata disagrees on the number of sequences ({num_seqs})",
    )
    require(meta.max_query_len >= 1, f"max_query_len must be >= 1, got {meta.max_query_len}")
    require(
        num_kv_splits is None or num_kv_splits >= 1,
        f"num_kv_splits must be None or >= 1, got {num_kv_splits}",
    )
    require(window >= 0 and softcap >= 0, f"window {window} and softcap {softcap} must be >= 0")

    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    config = launch_config(meta.max_query_len > 1 and not batch_invariant, dim_pad)
    block_q = max(1, config.rows // group_pad)
    tile_n = config.tile_n
    num_q_blocks = triton.cdiv(meta.max_query_len, block_q)
    num_splits = 1 if batch_invariant else num_kv_splits or meta.num_kv_splits
    if num_splits is None:
        # NUM_SPLITS is a compile-time constant: one value per batch shape would JIT-compile new
        # kernels while serving (seconds each on an H200). Powers of two bound that to a handful;
        # segments past a sequence's context are empty and drop out of the merge (lse = -inf).
        num_splits = triton.next_power_of_2(
            _default_num_splits(
                num_seqs * num_q_blocks * num_kv_heads, meta.max_seq_len, tile_n, query.device
            )
        )
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, dim_pad, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    _attention_kernel[(num_seqs, num_q_blocks * num_splits, num_kv_heads)](
        query,
        kv_layer,
        out,
        part_out,
        part_lse,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        meta.block_tables.stride(0),
        float(kv_scales[0]),
        float(kv_scales[1]),
        int(window),
        float(softcap),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP_PAD=group_pad,
        DIM_PAD=dim_pad,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        INTERPRETED_DOT=_IS_INTERPRETED,
        IS_FP8=is_fp8,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out


# Key-segment counts an eager step can pick (powers of two, _default_num_splits' cap).
EAGER_NUM_SPLITS = (1, 2, 4, 8, 16, 32)


def precompile_eager_variants(
    kv_layer: torch.Tensor,
    num_heads: int,
    dtype: torch.dtype,
    scorings: tuple[tuple[int, float], ...] = ((0, 0.0),),
) -> int:
    """Compiles, now, every variant an eager (prefill, mixed or decode) step can launch: each
    key-segment count with prefill and with decode tiles, and their merges, for each (window,
    softcap) the model's layers use. Left to the first step that needs one, a compile stalled
    serving for ~1 s (seen on an H200: 2 s of an 8 s offline run, a 1.3 s TTFT stall of a
    32-request burst). Returns the number of launches."""
    device = kv_layer.device
    head_dim = kv_layer.shape[-1]
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)  # a width of 1 would be a constant
    launches = 0
    for query_len in (2, 1):  # prefill tiles, decode tiles
        query = torch.zeros(query_len, num_heads, head_dim, dtype=dtype, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((query_len,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([query_len], dtype=torch.int32, device=device),
            block_tables=table,
            max_query_len=query_len,
            max_seq_len=query_len,
        )
        for num_splits in EAGER_NUM_SPLITS:
            for window, softcap in scorings:
                paged_attention_triton(
                    query,
                    kv_layer,
                    meta,
                    head_dim**-0.5,
                    window=window,
                    softcap=softcap,
                    num_kv_splits=num_splits,
                )
                launches += 1
    return launches
