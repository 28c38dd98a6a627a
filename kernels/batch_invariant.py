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


def _keys_first(x: torch.Tensor, pool_scale: float, num_q_heads: int) -> torch.Tensor:
    """[..., S, Hkv, D] from the pool -> [..., Hq, S, D] float32, each KV head repeated for its
    query heads."""
    from tandem.kernels.paged_attention import _from_pool

    x = _from_pool(x, torch.float32, pool_scale)
    return x.repeat_interleave(num_q_heads // x.shape[-2], dim=-2).transpose(-3, -2)


def _attend_tiles(
    query: torch.Tensor,
    positions: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    num_keys: int,
) -> torch.Tensor:
    """query [N, ROW_TILE, D] float32 (N tiles times heads) at positions [N, ROW_TILE] over
    key/value [N, S, D] float32 (S >= num_keys rounded up to KV_CHUNK, zero past each sequence's
    end) -> [N, ROW_TILE, D]: an online softmax over the chunks in order. Every bmm has items of
    one shape (a bmm's item does not change with the number of items: measured), and a chunk
    with no key a row may see leaves that row exactly as it was."""
    num_items, num_rows, head_dim = query.shape
    running_max = query.new_full((num_items, num_rows, 1), float("-inf"))
    running_sum = query.new_zeros((num_items, num_rows, 1))
    acc = query.new_zeros((num_items, num_rows, head_dim))
    positions = positions[:, :, None]
    for start in range(0, num_keys, KV_CHUNK):
        k = key[:, start : start + KV_CHUNK]
        v = value[:, start : start + KV_CHUNK]
        scores = torch.bmm(query, k.transpose(1, 2)) * scale
        key_pos = torch.arange(start, start + KV_CHUNK, device=query.device)
        scores = scores.masked_fill(key_pos[None, None, :] > positions, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        weights = torch.exp(scores - new_max)
        rescale = torch.exp(running_max - new_max)
        sees = positions >= start
        running_sum = torch.where(
            sees, running_sum * rescale + weights.sum(-1, keepdim=True), running_sum
        )
        acc = torch.where(sees, acc * rescale + torch.bmm(weights, v), acc)
        running_max = torch.where(sees, new_max, running_max)
    return acc / running_sum


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Causal GQA attention over the paged KV, as paged_attention.paged_attention, with a schedule
    that depends on each row's position alone: query rows in tiles of ROW_TILE, keys in chunks
    of KV_CHUNK from position 0, float32 throughout. Sequences of one tile (decodes, short
    chunks) share one bmm per chunk; a longer one runs its tiles against its own keys."""
    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    out = torch.empty_like(query)
    short = [b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] <= ROW_TILE]
    if short:
        _attend_short(query, kv_layer, meta, scale, kv_scales, short, out)
    for b in range(len(seq_lens)):
        if starts[b + 1] - starts[b] > ROW_TILE:
            _attend_long(query, kv_layer, meta, scale, kv_scales, b, out)
    return out


def _tile_positions(first: int, rows: int) -> torch.Tensor:
    """[ROW_TILE] positions of a tile's rows; padding rows repeat the last real one (they see
    keys: no NaN), and their output is dropped."""
    positions = torch.arange(first, first + ROW_TILE)
    return positions.clamp(max=first + rows - 1)


def _attend_short(query, kv_layer, meta, scale, kv_scales, seqs: list[int], out) -> None:
    """One tile per sequence, all in the same bmm calls."""
    from tandem.kernels.paged_attention import _gather_kv

    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    num_q_heads, head_dim = query.shape[1:]
    block_size = kv_layer.shape[2]
    max_len = max(seq_lens[b] for b in seqs)
    num_keys = -(-max_len // KV_CHUNK) * KV_CHUNK
    num_blocks = -(-max_len // block_size)
    index = torch.tensor(seqs, device=query.device)
    key, value = _gather_kv(kv_layer, meta.block_tables[index, :num_blocks])  # [B, S, Hkv, D]
    lens = meta.seq_lens[index].long()
    stale = torch.arange(key.shape[1], device=query.device)[None, :] >= lens[:, None]
    key = key.masked_fill(stale[:, :, None, None], 0)
    value = value.masked_fill(stale[:, :, None, None], 0)

    def items(x: torch.Tensor, pool_scale: float) -> torch.Tensor:
        x = _keys_first(x, pool_scale, num_q_heads)  # [B, Hq, S, D]
        x = torch.nn.functional.pad(x, (0, 0, 0, num_keys - x.shape[2]))
        return x.reshape(len(seqs) * num_q_heads, num_keys, head_dim)

    key, value = items(key, kv_scales[0]), items(value, kv_scales[1])
    q = query.new_zeros((len(seqs), ROW_TILE, num_q_heads, head_dim), dtype=torch.float32)
    positions = []
    for i, b in enumerate(seqs):
        rows = starts[b + 1] - starts[b]
        q[i, :rows] = query[starts[b] : starts[b + 1]]
        positions.append(_tile_positions(seq_lens[b] - rows, rows))
    q = q.transpose(1, 2).reshape(len(seqs) * num_q_heads, ROW_TILE, head_dim)
    positions = torch.stack(positions).to(query.device).repeat_interleave(num_q_heads, dim=0)
    result = _attend_tiles(q, positions, key, value, scale, max_len)
    result = result.view(len(seqs), num_q_heads, ROW_TILE, head_dim).transpose(1, 2)
    for i, b in enumerate(seqs):
        rows = starts[b + 1] - starts[b]
        out[starts[b] : starts[b + 1]] = result[i, :rows].to(query.dtype)


def _attend_long(query, kv_layer, meta, scale, kv_scales, b: int, out) -> None:
    """A sequence of several tiles, one tile at a time against its keys."""
    from tandem.kernels.paged_attention import _gather_kv

    start, end = meta.host_query_start_loc()[b : b + 2]
    seq_len = meta.host_seq_lens()[b]
    num_q_heads, head_dim = query.shape[1:]
    block_size = kv_layer.shape[2]
    num_blocks = -(-seq_len // block_size)
    key, value = _gather_kv(kv_layer, meta.block_tables[b, :num_blocks])  # [S, Hkv, D]
    num_keys = -(-seq_len // KV_CHUNK) * KV_CHUNK

    def items(x: torch.Tensor, pool_scale: float) -> torch.Tensor:
        x = _keys_first(x[:seq_len], pool_scale, num_q_heads)  # [Hq, S, D]
        return torch.nn.functional.pad(x, (0, 0, 0, num_keys - seq_len)).contiguous()

    key, value = items(key, kv_scales[0]), items(value, kv_scales[1])
    first_pos = seq_len - (end - start)
    for tile_start in range(start, end, ROW_TILE):
        rows = min(ROW_TILE, end - tile_start)
        q = _pad_rows(query[tile_start : tile_start + rows].float(), ROW_TILE).transpose(0, 1)
        positions = _tile_positions(first_pos + tile_start - start, rows).to(query.device)
        result = _attend_tiles(
            q.contiguous(),
            positions[None].expand(num_q_heads, ROW_TILE),
            key,
            value,
            scale,
            first_pos + tile_start - start + rows,
        )
        out[tile_start : tile_start + rows] = result.transpose(0, 1)[:rows].to(query.dtype)
