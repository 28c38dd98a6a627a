"""Torch reference for the paged KV cache: the CPU path and the oracle for Triton kernels.

Whole-worker cache: `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`,
block-major so that one block of every layer is one contiguous byte range (one NIXL
descriptor per block). A layer works on `kv_cache[:, layer]`:
`[num_blocks, 2, block_size, num_kv_heads, head_dim]`.

An FP8 pool (float8_e4m3fn) holds key / k_scale and value / v_scale, one pair of scales per
layer (kv_scales); attention reads them back times the scale, in the query's dtype.

A layer may bound what a query sees: `window` > 0 keeps the keys at positions > q_pos - window
(transformers' sliding_window_overlay: the query's own key and the window - 1 before it); the
older keys stay in the cache, masked. `softcap` > 0 squashes each scaled score to
softcap * tanh(score / softcap) before the softmax (Gemma 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.attention_metadata import AttentionMetadata

FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max


def _to_pool(x: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    if pool_dtype != FP8:
        return x.to(pool_dtype)
    # Saturate: a cast of a value past 448 to e4m3fn gives NaN. Times the inverse, not divided:
    # the Triton kernels multiply too (an IEEE product on every device), so both write one byte.
    return (x.float() * (1.0 / scale)).clamp(-_FP8_MAX, _FP8_MAX).to(FP8)


def _from_pool(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale).to(dtype) if scale != 1.0 else x.to(dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Writes token i's key/value [T, Hkv, D] to slot `slot_mapping[i]` (-1: skip)."""
    block_size = kv_layer.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_layer[block_ids, 0, offsets] = _to_pool(key, kv_layer.dtype, kv_scales[0])
    kv_layer[block_ids, 1, offsets] = _to_pool(value, kv_layer.dtype, kv_scales[1])


def _gather_kv(
    kv_layer: torch.Tensor, block_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., num_blocks] block ids -> key, value [..., num_blocks * block_size, Hkv, D]."""
    blocks = kv_layer[block_table.long()]  # [..., nb, 2, bs, Hkv, D]
    lead = blocks.shape[:-5]
    nb, _, bs, hkv, d = blocks.shape[-5:]
    key = blocks.select(-4, 0).reshape(*lead, nb * bs, hkv, d)
    value = blocks.select(-4, 1).reshape(*lead, nb * bs, hkv, d)
    return key, value


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """[..., Hq, Q, D] over [..., Hkv, S, D] with a boolean mask (True: visible)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )
    group = query.shape[-3] // key.shape[-3]
    key = key.repeat_interleave(group, dim=-3)
    value = value.repeat_interleave(group, dim=-3)
    # As transformers' eager Gemma 2: scale, cap, mask, a float32 softmax, back to the dtype.
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def _decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: tuple[float, float],
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence, batched: query [B, Hq, D] -> [B, Hq, D]."""
    block_size = kv_layer.shape[2]
    num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    key, value = _gather_kv(kv_layer, block_tables[:, :num_blocks])  # [B, S, Hkv, D]
    positions = torch.arange(key.shape[1], device=query.device)
    mask = positions[None, :] < seq_lens[:, None]
    if window > 0:  # the query sits at seq_len - 1
        mask &= positions[None, :] > seq_lens[:, None] - 1 - window
    out = _attention(
        query.unsqueeze(2),
        _from_pool(key.transpose(1, 2), query.dtype, kv_scales[0]),
        _from_pool(value.transpose(1, 2), query.dtype, kv_scales[1]),
        mask.view(-1, 1, 1, key.shape[1]),
        scale,
        softcap,
    )
    return out.squeeze(2)


def _prefill_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    kv_scales: tuple[float, float],
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [Q, Hq, D] are the last Q of seq_len tokens; causal over the whole sequence."""
    block_size = kv_layer.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    key, value = _gather_kv(kv_layer, block_table[:num_blocks])
    key, value = key[:seq_len].transpose(0, 1), value[:seq_len].transpose(0, 1)  # [Hkv, S, D]
    query_len = query.shape[0]
    # Query row i sits at absolute position seq_len - query_len + i: it sees keys up to there.
    q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    mask = key_pos <= q_pos[:, None]
    if window > 0:
        mask &= key_pos > q_pos[:, None] - window
    out = _attention(
        query.transpose(0, 1),
        _from_pool(key, query.dtype, kv_scales[0]),
        _from_pool(value, query.dtype, kv_scales[1]),
        mask,
        scale,
        softcap,
    )
    return out.transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its whole paged KV.

    query [T, Hq, D] -> [T, Hq, D]. The new tokens' KV must already be stored. window > 0: each
    query sees its last `window` keys only; softcap > 0: scores capped (module docstring).
    """
    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    if meta.max_query_len == 1:
        return _decode_attention(
            query, kv_layer, meta.block_tables, meta.seq_lens, scale, kv_scales, window, softcap
        )
    out = torch.empty_like(query)
    decode_ids = [b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] == 1]
    if decode_ids:
        index = torch.tensor(decode_ids, device=query.device)
        rows = meta.query_start_loc[index].long()
        out[rows] = _decode_attention(
            query[rows],
            kv_layer,
            meta.block_tables[index],
            meta.seq_lens[index],
            scale,
            kv_scales,
            window,
            softcap,
        )
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        if end - start > 1:
            out[start:end] = _prefill_attention(
                query[start:end],
                kv_layer,
                meta.block_tables[b],
                seq_len,
                scale,
                kv_scales,
                window,
                softcap,
            )
    return out
