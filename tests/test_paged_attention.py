"""The torch reference paged attention against dense causal attention on random inputs."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.paged_attention import paged_attention, store_kv


def dense_attention(query, key, value, scale):
    """query [Q, Hq, D] are the last Q rows of key/value [S, Hkv, D]; naive causal softmax."""
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.repeat_interleave(group, dim=1).double()
    value = value.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), key) * scale
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


CASES = [
    # (block_size, num_heads, num_kv_heads, head_dim, [(query_len, seq_len), ...])
    (4, 4, 2, 16, [(1, 1), (1, 7), (1, 13)]),  # decode only
    (16, 8, 8, 32, [(20, 20)]),  # one prefill, MHA
    (8, 8, 1, 64, [(5, 5), (1, 30), (7, 19), (1, 2)]),  # mixed, MQA, chunk continuing a prefix
    (1, 6, 3, 8, [(3, 10), (1, 4)]),  # block size 1
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,shape", CASES)
def test_paged_matches_dense(block_size, num_heads, num_kv_heads, head_dim, shape, dtype):
    gen = torch.Generator().manual_seed(block_size * 1000 + num_heads * 10 + head_dim)
    num_blocks = sum((s + block_size - 1) // block_size for _, s in shape) + 5
    num_layers = 2
    kv_cache = torch.randn(
        num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen
    ).to(dtype)
    kv_layer = kv_cache[:, 1]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values, queries = [], [], [], []
    for query_len, seq_len in shape:
        tables.append([free.pop() for _ in range((seq_len + block_size - 1) // block_size)])
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
    # Store each sequence's earlier context first, as earlier steps would have.
    for (query_len, seq_len), table, k, v in zip(shape, tables, keys, values):
        prefix = AttentionMetadata.build([seq_len], [seq_len], [table], block_size)
        store_kv(k, v, kv_layer, prefix.slot_mapping)
    meta = AttentionMetadata.build([q for q, _ in shape], [s for _, s in shape], tables, block_size)
    new_k = torch.cat([k[s - q :] for (q, s), k in zip(shape, keys)])
    new_v = torch.cat([v[s - q :] for (q, s), v in zip(shape, values)])
    store_kv(new_k, new_v, kv_layer, meta.slot_mapping)

    scale = head_dim**-0.5
    out = paged_attention(torch.cat(queries), kv_layer, meta, scale)
    expected = torch.cat(
        [dense_attention(q, k, v, scale) for q, k, v in zip(queries, keys, values)]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_store_kv_skips_negative_slots_and_writes_block_major():
    kv_cache = torch.zeros(3, 2, 2, 4, 1, 2)
    key = torch.arange(1.0, 7.0).view(3, 1, 2)
    store_kv(key, -key, kv_cache[:, 1], torch.tensor([5, -1, 11]))
    assert torch.equal(kv_cache[1, 1, 0, 1], key[0]) and torch.equal(kv_cache[1, 1, 1, 1], -key[0])
    assert torch.equal(kv_cache[2, 1, 0, 3], key[2])
    assert kv_cache[:, 0].abs().sum() == 0
    assert int((kv_cache != 0).sum()) == 8  # two tokens x (k, v) x 2 dims
    # One block of all layers is one contiguous byte range: what a NIXL descriptor covers.
    assert kv_cache[1].is_contiguous()


def test_build_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([3], [9], [[0, 1]], block_size=4)
