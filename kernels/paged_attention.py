"""Torch reference for the paged KV cache: the CPU path and the oracle for Triton kernels.

Whole-worker cache: `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`,
block-major so that one block of every layer is one contiguous byte range (one NIXL
descriptor per block). A layer works on `kv_cache[:, layer]`:
`[num_blocks, 2, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.attention_metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes token i's key/value [T, Hkv, D] to slot `slot_mapping[i]` (-1: skip)."""
    block_size = kv_layer.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_layer[block_ids, 0, offsets] = key.to(kv_layer.dtype)
    kv_layer[block_ids, 1, offsets] = value.to(kv_layer.dtype)


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


def _decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, batched: query [B, Hq, D] -> [B, Hq, D]."""
    block_size = kv_layer.shape[2]
    num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    key, value = _gather_kv(kv_layer, block_tables[:, :num_blocks])  # [B, S, Hkv, D]
    positions = torch.arange(key.shape[1], device=query.device)
    mask = (positions[None, :] < seq_lens[:, None]).view(-1, 1, 1, key.shape[1])
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        key.transpose(1, 2).to(query.dtype),
        value.transpose(1, 2).to(query.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _prefill_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """query [Q, Hq, D] are the last Q of seq_len tokens; causal over the whole sequence."""
    block_size = kv_layer.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    key, value = _gather_kv(kv_layer, block_table[:num_blocks])
    key, value = key[:seq_len].transpose(0, 1), value[:seq_len].transpose(0, 1)  # [Hkv, S, D]
    query_len = query.shape[0]
    # Query row i sits at absolute position seq_len - query_len + i: it sees keys up to there.
    q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
    mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.to(query.dtype),
        value.to(query.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its whole paged KV.

    query [T, Hq, D] -> [T, Hq, D]. The new tokens' KV must already be stored.
    """
    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    if meta.max_query_len == 1:
        return _decode_attention(query, kv_layer, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(query)
    decode_ids = [b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] == 1]
    if decode_ids:
        index = torch.tensor(decode_ids, device=query.device)
        rows = meta.query_start_loc[index].long()
        out[rows] = _decode_attention(
            query[rows], kv_layer, meta.block_tables[index], meta.seq_lens[index], scale
        )
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        if end - start > 1:
            out[start:end] = _prefill_attention(
                query[start:end], kv_layer, meta.block_tables[b], seq_len, scale
            )
    return out
