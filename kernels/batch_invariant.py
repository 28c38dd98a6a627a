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

On a GPU the torch schedule above is not enough: cuBLAS picks its batched-GEMM kernel by the
number of items, and torch's CUDA reductions split a row's sum differently with the number of
rows. There attention runs the Triton kernel with one launch configuration and one key segment
for every step (a row's keys in the same tiles, in the same order, in a decode step or in any
prefill chunk), and GEMMs run in calls of GPU_ROW_TILE rows; the norms, SwiGLU, rotary and the
greedy draw are Triton kernels of one program per row already.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from tandem.kernels.attention_metadata import AttentionMetadata

# Rows per attention tile of the torch schedule, and per GEMM call on the CPU: 16 rows keep a
# decode step's padding small and a prefill's calls few.
ROW_TILE = 16
# Rows per GEMM call on a GPU. A cuBLAS call of a few hundred rows still costs about one read of
# the weights, and every tile of a step reads them again: measured on an H100 with the 8B shape
# (bench/deterministic.py --gpu-row-tile, bench/RESULTS.md), 64 / 128 / 256 rows gave the
# default's 0.78 / 0.75 / 0.64x at batch 1, 0.50 / 0.64 / 0.71x at 64 concurrent and
# 0.24 / 0.42 / 0.70x on prefill: 256 rows, the best over the rows together.
GPU_ROW_TILE = 256
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


def gemm_row_tile(device: torch.device) -> int:
    """Rows per GEMM call on `device`: fixed per device type, whatever the step holds."""
    return GPU_ROW_TILE if device.type == "cuda" else ROW_TILE


def schedule_id(device: torch.device, backend: str) -> str:
    """Names the schedule a deterministic worker on `device` computes with (part of its KV layout:
    two schedules give other bits, so their workers do not hand KV to each other)."""
    attention = "triton-pinned" if backend == "triton" else f"torch-chunk{KV_CHUNK}"
    return f"{device.type}/{attention}/gemm-rows{gemm_row_tile(device)}"


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over x [T, K] in calls of exactly gemm_row_tile rows (zero-padded), concatenated:
    [T, N]."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return fn(x)
    tile = gemm_row_tile(x.device)
    padded_rows = -(-num_rows // tile) * tile
    if padded_rows != num_rows:
        x = torch.cat([x, x.new_zeros(padded_rows - num_rows, *x.shape[1:])])
    else:
        x = x.contiguous()
    tiles = [fn(x[start : start + tile]) for start in range(0, padded_rows, tile)]
    return torch.cat(tiles)[:num_rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias), ROW_TILE rows per GEMM."""
    return tiled_rows(lambda tile: torch.nn.functional.linear(tile, weight, bias), x)


def _kv_heads_first(x: torch.Tensor, pool_scale: float) -> torch.Tensor:
    """[..., S, Hkv, D] from the pool -> [..., Hkv, S, D] float32."""
    from tandem.kernels.paged_attention import _from_pool

    return _from_pool(x, torch.float32, pool_scale).transpose(-3, -2)


def _tiled_rows(query: torch.Tensor, num_kv_heads: int, first_pos: int):
    """A sequence's query rows [Q, Hq, D] as tiles of each KV head: ([Hkv, n, ROW_TILE, D]
    float32, positions [n, ROW_TILE]). A KV head's rows are its g query heads at each position,
    position-major; padding rows repeat the last real position (they see keys: no NaN) and are
    dropped by _untiled_rows."""
    num_rows, num_q_heads, head_dim = query.shape
    group = num_q_heads // num_kv_heads
    num_real = num_rows * group
    num_tiles = -(-num_real // ROW_TILE)
    rows = query.float().view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
    rows = rows.reshape(num_kv_heads, num_real, head_dim)
    rows = torch.nn.functional.pad(rows, (0, 0, 0, num_tiles * ROW_TILE - num_real))
    positions = (torch.arange(num_tiles * ROW_TILE) // group).clamp(max=num_rows - 1) + first_pos
    return (
        rows.view(num_kv_heads, num_tiles, ROW_TILE, head_dim),
        positions.view(num_tiles, ROW_TILE).to(query.device),
    )


def _untiled_rows(tiles: torch.Tensor, num_rows: int, num_q_heads: int) -> torch.Tensor:
    """[Hkv, n, ROW_TILE, D] from _tiled_rows -> the sequence's [Q, Hq, D]."""
    num_kv_heads, _, _, head_dim = tiles.shape
    group = num_q_heads // num_kv_heads
    rows = tiles.reshape(num_kv_heads, -1, head_dim)[:, : num_rows * group]
    return (
        rows.view(num_kv_heads, num_rows, group, head_dim)
        .transpose(0, 1)
        .reshape(num_rows, num_q_heads, head_dim)
    )


def _attend_tiles(
    query: torch.Tensor,
    positions: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    num_keys: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [N, ROW_TILE, D] float32 (N tiles times KV heads) at positions [N, ROW_TILE] over
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
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos = torch.arange(start, start + KV_CHUNK, device=query.device)
        hidden = key_pos[None, None, :] > positions
        sees = positions >= start
        if window > 0:  # a chunk wholly older than a row's window leaves the row as it was
            hidden |= key_pos[None, None, :] <= positions - window
            sees &= positions - window < start + KV_CHUNK - 1
        scores = scores.masked_fill(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        weights = torch.exp(scores - new_max)
        rescale = torch.exp(running_max - new_max)
        running_sum = torch.where(
            sees, running_sum * rescale + weights.sum(-1, keepdim=True), running_sum
        )
        acc = torch.where(sees, acc * rescale + torch.bmm(weights, v), acc)
        running_max = torch.where(sees, new_max, running_max)
    return acc / running_sum


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal GQA attention over the paged KV, as paged_attention.paged_attention, with a schedule
    that depends on each row's position alone: the rows of a KV head (its query heads at each
    position) in tiles of ROW_TILE, keys in chunks of KV_CHUNK from position 0, float32
    throughout. Sequences of one tile per KV head (decodes, short chunks) share one bmm per
    chunk; a longer one runs its tiles against its own keys, one tile at a time.

    On the Triton backend: the GPU kernel with its schedule pinned (one launch configuration for
    every step, keys walked from position 0 in one segment), whose rows do not depend on their
    neighbours either; it reads no host-side list, so decode CUDA graphs capture it."""
    from tandem.kernels.dispatch import backend_for

    if backend_for(kv_layer.device) == "triton":
        from tandem.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            query, kv_layer, meta, scale, kv_scales, window, softcap, batch_invariant=True
        )
    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    group = query.shape[1] // kv_layer.shape[-2]
    out = torch.empty_like(query)
    is_short = [(starts[b + 1] - starts[b]) * group <= ROW_TILE for b in range(len(seq_lens))]
    short = [b for b, flag in enumerate(is_short) if flag]
    if short:
        _attend_short(query, kv_layer, meta, (scale, window, softcap), kv_scales, short, out)
    for b, flag in enumerate(is_short):
        if not flag:
            _attend_long(query, kv_layer, meta, (scale, window, softcap), kv_scales, b, out)
    return out


def _attend_short(query, kv_layer, meta, scoring, kv_scales, seqs: list[int], out) -> None:
    """One tile per sequence and KV head, all in the same bmm calls. scoring: (scale, window,
    softcap)."""
    from tandem.kernels.paged_attention import _gather_kv

    starts = meta.host_query_start_loc()
    seq_lens = meta.host_seq_lens()
    num_q_heads = query.shape[1]
    block_size, num_kv_heads, head_dim = kv_layer.shape[2], kv_layer.shape[-2], kv_layer.shape[-1]
    max_len = max(seq_lens[b] for b in seqs)
    num_keys = -(-max_len // KV_CHUNK) * KV_CHUNK
    index = torch.tensor(seqs, device=query.device)
    key, value = _gather_kv(kv_layer, meta.block_tables[index, : -(-max_len // block_size)])
    # Zero past each sequence's end (not the pool's stale bytes: 0 * NaN is NaN) and to num_keys.
    stale = torch.arange(key.shape[1], device=query.device)[None, :] >= meta.seq_lens[index, None]

    def items(x: torch.Tensor, pool_scale: float) -> torch.Tensor:
        x = _kv_heads_first(x.masked_fill(stale[:, :, None, None], 0), pool_scale)
        x = torch.nn.functional.pad(x, (0, 0, 0, num_keys - x.shape[2]))  # [B, Hkv, S, D]
        return x.reshape(len(seqs) * num_kv_heads, num_keys, head_dim)

    key, value = items(key, kv_scales[0]), items(value, kv_scales[1])
    tiles = [
        _tiled_rows(
            query[starts[b] : starts[b + 1]], num_kv_heads, seq_lens[b] - starts[b + 1] + starts[b]
        )
        for b in seqs
    ]
    q = torch.cat([rows for rows, _ in tiles]).view(len(seqs) * num_kv_heads, ROW_TILE, head_dim)
    positions = torch.cat([p for _, p in tiles]).repeat_interleave(num_kv_heads, dim=0)
    result = _attend_tiles(q, positions, key, value, scoring[0], max_len, *scoring[1:])
    result = result.view(len(seqs), num_kv_heads, 1, ROW_TILE, head_dim)
    for i, b in enumerate(seqs):
        rows = starts[b + 1] - starts[b]
        out[starts[b] : starts[b + 1]] = _untiled_rows(result[i], rows, num_q_heads).to(query.dtype)


def _attend_long(query, kv_layer, meta, scoring, kv_scales, b: int, out) -> None:
    """A sequence of several tiles per KV head, one tile at a time against its keys. scoring:
    (scale, window, softcap)."""
    from tandem.kernels.paged_attention import _gather_kv

    start, end = meta.host_query_start_loc()[b : b + 2]
    seq_len = meta.host_seq_lens()[b]
    num_q_heads = query.shape[1]
    num_kv_heads = kv_layer.shape[-2]
    group = num_q_heads // num_kv_heads
    num_blocks = -(-seq_len // kv_layer.shape[2])
    key, value = _gather_kv(kv_layer, meta.block_tables[b, :num_blocks])  # [S, Hkv, D]
    num_keys = -(-seq_len // KV_CHUNK) * KV_CHUNK

    def items(x: torch.Tensor, pool_scale: float) -> torch.Tensor:
        x = _kv_heads_first(x[:seq_len], pool_scale)  # [Hkv, S, D]
        return torch.nn.functional.pad(x, (0, 0, 0, num_keys - seq_len)).contiguous()

    key, value = items(key, kv_scales[0]), items(value, kv_scales[1])
    first_pos = seq_len - (end - start)
    rows, positions = _tiled_rows(query[start:end], num_kv_heads, first_pos)
    result = torch.empty_like(rows)
    for tile in range(rows.shape[1]):
        # The tile's last row's position, on the host: the keys it walks.
        last_pos = min(first_pos + ((tile + 1) * ROW_TILE - 1) // group, seq_len - 1)
        result[:, tile] = _attend_tiles(
            rows[:, tile].contiguous(),
            positions[tile][None].expand(num_kv_heads, ROW_TILE),
            key,
            value,
            scoring[0],
            last_pos + 1,
            *scoring[1:],
        )
    out[start:end] = _untiled_rows(result, end - start, num_q_heads).to(query.dtype)
