"""Batch-invariant schedules for --deterministic: a row's result depends on that row alone.

A GEMM library picks its blocking (and its GEMV or GEMM kernel) by the shape of the call, so a
token's projection changes in the last bits with the number of rows it is batched with
(measured on the CPU build: one row against two, and any M past a few rows, differ). Fixed
shapes remove that: every GEMM here runs on tiles of exactly ROW_TILE rows (the last padded),
and a row's result in a fixed-shape call does not depend on its neighbours or its place in the
tile (measured too, tests/test_deterministic.py checks the whole model end to end).

Attention walks each sequence's keys in chunks of KV_CHUNK tokens from position 0, whatever
the step holds: a query row sees the same chunks in the same order in a decode step, in any
prefill chunk and in any batch. A chunk wholly after a row's position adds exact zeros (its
scores are -inf, its weights 0, the running max and sum unchanged), so the number of chunks a
tile walks past a row does not change the row.

The rest of the decoder is row-wise already on the CPU (RMSNorm's mean, the sampler's softmax,
log-sum-exp and sorts reduce within a row; measured bitwise equal for 1 to 256 rows).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from tandem.kernels.attention_metadata import AttentionMetadata

# Rows per GEMM call. 16 rows keep a decode step's padding small and a prefill's calls few.
ROW_TILE = 16
# Keys per attention chunk, from position 0 of the sequence.
KV_CHUNK = 128

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant", default=False)


def is_enabled() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within the block (on this thread), the dispatched kernels use the batch-invariant
    schedules. A context variable rather than a global: engines of both modes share a process."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over x [T, K] in calls of exactly ROW_TILE rows (zero-padded), concatenated: [T, N]."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return fn(x)
    padded_rows = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded_rows != num_rows:
        x = torch.cat([x, x.new_zeros(padded_rows - num_rows, *x.shape[1:])])
    else:
        x = x.contiguous()
    tiles = [fn(x[start : start + ROW_TILE]) for start in range(0, padded_rows, ROW_TILE)]
    return torch.cat(tiles)[:num_rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias), ROW_TILE rows per GEMM."""
    return tiled_rows(lambda tile: torch.nn.functional.linear(tile, weight, bias), x)


def _sequence_kv(
    kv_layer: torch.Tensor, block_table: torch.Tensor, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first num_keys keys and values of a sequence, [num_keys, Hkv, D] each."""
    block_size = kv_layer.shape[2]
    num_blocks = -(-num_keys // block_size)
    blocks = kv_layer[block_table[:num_blocks].long()]  # [nb, 2, bs, Hkv, D]
    hkv, d = blocks.shape[-2:]
    key = blocks[:, 0].reshape(num_blocks * block_size, hkv, d)[:num_keys]
    value = blocks[:, 1].reshape(num_blocks * block_size, hkv, d)[:num_keys]
    return key, value


def _heads_first(
    x: torch.Tensor, pool_scale: float, num_q_heads: int, num_padded_keys: int
) -> torch.Tensor:
    """[S, Hkv, D] from the pool -> [Hq, num_padded_keys, D] float32, each KV head repeated for
    its query heads, zero past S (not the pool's stale bytes: 0 * NaN is NaN)."""
    from tandem.kernels.paged_attention import _from_pool

    x = _from_pool(x, torch.float32, pool_scale)
    x = x.repeat_interleave(num_q_heads // x.shape[1], dim=1).transpose(0, 1)
    return torch.nn.functional.pad(x, (0, 0, 0, num_padded_keys - x.shape[1])).contiguous()


def _attend_tile(
    query: torch.Tensor,
    positions: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    num_keys: int,
) -> torch.Tensor:
    """query [H, ROW_TILE, D] float32 at positions [ROW_TILE] (the last is num_keys - 1) over key/value [H, S, D] float32 (S a
    multiple of KV_CHUNK, zero past the sequence) -> [H, ROW_TILE, D]: an online softmax over
    the chunks in order, every matmul of one shape."""
    num_heads, num_rows, head_dim = query.shape
    running_max = query.new_full((num_heads, num_rows, 1), float("-inf"))
    running_sum = query.new_zeros((num_heads, num_rows, 1))
    acc = query.new_zeros((num_heads, num_rows, head_dim))
    for start in range(0, num_keys, KV_CHUNK):
        k = key[:, start : start + KV_CHUNK]
        v = value[:, start : start + KV_CHUNK]
        scores = torch.bmm(query, k.transpose(1, 2)) * scale
        key_pos = torch.arange(start, start + KV_CHUNK, device=query.device)
        scores = scores.masked_fill(
            key_pos[None, None, :] > positions[None, :, None], float("-inf")
        )
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        weights = torch.exp(scores - new_max)
        rescale = torch.exp(running_max - new_max)
        running_sum = running_sum * rescale + weights.sum(-1, keepdim=True)
        acc = acc * rescale + torch.bmm(weights, v)
        running_max = new_max
    return acc / running_sum


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Causal GQA attention over the paged KV, as paged_attention.paged_attention, with a schedule
    that depends on each row's position alone: query rows in tiles of ROW_TILE, keys in chunks
    of KV_CHUNK from position 0, float32 throughout."""
    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    num_q_heads = query.shape[1]
    out = torch.empty_like(query)
    for b, seq_len in enumerate(seq_lens):
        start, end = starts[b], starts[b + 1]
        num_padded_keys = -(-seq_len // KV_CHUNK) * KV_CHUNK
        key, value = _sequence_kv(kv_layer, meta.block_tables[b], seq_len)
        key = _heads_first(key, kv_scales[0], num_q_heads, num_padded_keys)
        value = _heads_first(value, kv_scales[1], num_q_heads, num_padded_keys)
        query_len = end - start
        first_pos = seq_len - query_len
        for tile_start in range(0, query_len, ROW_TILE):
            rows = min(ROW_TILE, query_len - tile_start)
            q = query.new_zeros((ROW_TILE, num_q_heads, query.shape[2]), dtype=torch.float32)
            q[:rows] = query[start + tile_start : start + tile_start + rows]
            # Padding rows sit at the tile's last real position: they see keys, never NaN.
            positions = torch.full((ROW_TILE,), first_pos + tile_start + rows - 1)
            positions[:rows] = torch.arange(first_pos + tile_start, first_pos + tile_start + rows)
            tile_out = _attend_tile(
                q.transpose(0, 1).contiguous(),
                positions.to(query.device),
                key,
                value,
                scale,
                first_pos + tile_start + rows,
            )
            out[start + tile_start : start + tile_start + rows] = tile_out.transpose(0, 1)[
                :rows
            ].to(query.dtype)
    return out
