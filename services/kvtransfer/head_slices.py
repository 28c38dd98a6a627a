"""Which bytes of which prefill rank land where in which decode rank, for handoffs between
workers of different tensor-parallel sizes.

A rank's pool is [num_blocks, num_layers, 2, block_size, heads_per_rank, head_dim]: with the same
TP size on both sides, rank r's blocks go whole to rank r (one descriptor per run of blocks, as
at TP 1). With different sizes, decode rank j owns heads [j*Hd, (j+1)*Hd) and prefill rank i holds
[i*Hp, (i+1)*Hp); each overlap is contiguous only within one (layer, k/v, token) row of a block, so
it moves as one descriptor per block and row: num_layers * 2 * block_size per block and overlap.
That is the price of keeping the TP-1 layout (and its kernels) unchanged; a heads-outer layout
would make it one descriptor per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.common.block_runs import coalesce_runs


@dataclass(frozen=True)
class PoolGeometry:
    """What both sides agree on (the layout hash covers it) plus each side's TP size."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    itemsize: int

    def heads_per_rank(self, tp_size: int) -> int:
        return self.num_kv_heads // tp_size

    def block_nbytes(self, tp_size: int) -> int:
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.heads_per_rank(tp_size)
            * self.head_dim
            * self.itemsize
        )


def split_runs(
    runs: list[tuple[int, int, int]], max_blocks: int | None
) -> list[tuple[int, int, int]]:
    """Cuts runs longer than max_blocks: several descriptors let the backend move them in parallel."""
    if not max_blocks:
        return runs
    out = []
    for remote_start, local_start, count in runs:
        for offset in range(0, count, max_blocks):
            out.append(
                (remote_start + offset, local_start + offset, min(max_blocks, count - offset))
            )
    return out


def read_plan(
    remote_block_ids: list[int],
    local_block_ids: list[int],
    geometry: PoolGeometry,
    remote_tp: int,
    local_tp: int,
    max_run_blocks: int | None = None,
) -> np.ndarray:
    """Rows of (remote_rank, remote_byte_offset, local_rank, local_byte_offset, nbytes), offsets
    from the start of each rank's pool, that together copy the blocks' KV of every head."""
    if remote_tp == local_tp:
        block_nbytes = geometry.block_nbytes(local_tp)
        runs = split_runs(coalesce_runs(remote_block_ids, local_block_ids), max_run_blocks)
        return np.array(
            [
                (rank, remote * block_nbytes, rank, local * block_nbytes, n * block_nbytes)
                for rank in range(local_tp)
                for remote, local, n in runs
            ],
            dtype=np.int64,
        ).reshape(-1, 5)
    remote_heads, local_heads = (
        geometry.heads_per_rank(remote_tp),
        geometry.heads_per_rank(local_tp),
    )
    row_bytes = geometry.head_dim * geometry.itemsize  # one head of one token
    num_rows = geometry.num_layers * 2 * geometry.block_size
    rows = np.arange(num_rows, dtype=np.int64)
    remote_blocks = np.asarray(remote_block_ids, dtype=np.int64)
    local_blocks = np.asarray(local_block_ids, dtype=np.int64)
    pieces = []
    for local_rank in range(local_tp):
        owned_start, owned_end = local_rank * local_heads, (local_rank + 1) * local_heads
        for remote_rank in range(remote_tp):
            start = max(owned_start, remote_rank * remote_heads)
            end = min(owned_end, (remote_rank + 1) * remote_heads)
            if start >= end:
                continue
            # [blocks, rows] grids of byte offsets, block-major.
            remote = (
                remote_blocks[:, None] * geometry.block_nbytes(remote_tp)
                + rows[None, :] * remote_heads * row_bytes
                + (start - remote_rank * remote_heads) * row_bytes
            )
            local = (
                local_blocks[:, None] * geometry.block_nbytes(local_tp)
                + rows[None, :] * local_heads * row_bytes
                + (start - owned_start) * row_bytes
            )
            piece = np.empty((remote.size, 5), dtype=np.int64)
            piece[:, 0], piece[:, 1] = remote_rank, remote.ravel()
            piece[:, 2], piece[:, 3] = local_rank, local.ravel()
            piece[:, 4] = (end - start) * row_bytes
            pieces.append(piece)
    return np.concatenate(pieces) if pieces else np.zeros((0, 5), dtype=np.int64)
