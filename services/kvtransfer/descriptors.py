"""NIXL descriptors of a READ: checked block ids, the prepared per-block lists and their indices,
and the per-READ lists of a head-slice plan.

Two ways to describe one READ to NIXL:

- prepared: one descriptor per (rank, block) of a pool, handed to `prep_xfer_dlist` once (ours at
  open, a peer's when it is added); a READ is then two index arrays for `make_prepped_xfer`, which
  merges indices whose blocks are adjacent on both sides into one descriptor, so a run of blocks
  still moves as one range. Worth keeping: on CPU a 256-block run of 64 KiB blocks pulled in
  2.36 ms as one descriptor, 3.00 ms as 256 (skip_desc_merge); with 4 MiB blocks the two were
  equal. Used whenever both sides have the same TP size.
- planned: `read_plan`'s rows turned into (address, length, device) lists for `initialize_xfer`,
  which checks and prepares them on every READ. Needed when the TP sizes differ (a head slice is
  a piece of each (layer, k/v, token) row of a block: prepared, a pool's rows would be millions
  of descriptors) or when runs are cut at max_descriptor_bytes (NIXL's merge would
  glue the pieces back together).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def block_id_array(side: str, block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
    """The ids as int64 once each is an int in [0, num_blocks); ValueError naming the first that
    is not.

    A list of plain ints (what the workers pass) is checked with C-level builtins; anything else
    (numpy integers, a bad id) goes element by element.
    """
    if isinstance(block_ids, (list, tuple)) and set(map(type, block_ids)) <= {int}:
        if not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks):
            return np.array(block_ids, dtype=np.int64)
    for block_id in block_ids:
        if not isinstance(block_id, (int, np.integer)) or isinstance(block_id, bool):
            raise ValueError(f"{side} block id {block_id!r} is not an integer")
        if not 0 <= block_id < num_blocks:
            raise ValueError(f"{side} block id {block_id} is out of range [0, {num_blocks})")
    return np.array(block_ids, dtype=np.int64).reshape(-1)


def block_descriptors(
    rank_pools: Sequence[tuple[int, int]], num_blocks: int, block_nbytes: int
) -> np.ndarray:
    """(address, length, device) of every block of every rank's pool, rank-major: block b of rank
    r is row r * num_blocks + b, the index `prepped_indices` gives it."""
    pools = np.array(rank_pools, dtype=np.uint64).reshape(-1, 2)
    offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    descriptors = np.empty((len(pools), num_blocks, 3), dtype=np.uint64)
    descriptors[:, :, 0] = pools[:, :1] + offsets[None, :]
    descriptors[:, :, 1] = block_nbytes
    descriptors[:, :, 2] = pools[:, 1:]
    return descriptors.reshape(-1, 3)


def prepped_indices(block_ids: np.ndarray, num_blocks: int, tp_size: int) -> np.ndarray:
    """Rows of `block_descriptors` for the blocks on every rank, rank-major, as both sides list
    them: rank r of the peer pairs with our rank r."""
    if tp_size == 1:
        return block_ids
    ranks = np.arange(tp_size, dtype=np.int64)[:, None] * num_blocks
    return (ranks + block_ids[None, :]).reshape(-1)


def count_runs(remote_ids: np.ndarray, local_ids: np.ndarray) -> int:
    """Runs of blocks consecutive on both sides: the descriptors NIXL is left with per rank once
    it has merged adjacent ones (as coalesce_runs groups them)."""
    if not len(remote_ids):
        return 0
    # Each (remote, local) pair packed into one int64 (ids are far below 2**31): a run goes on
    # where the packed pair grows by exactly 2**32 + 1. Half the numpy calls of two diffs, which
    # is what this costs at a READ's sizes.
    pairs = (remote_ids << 32) + local_ids
    return 1 + int(np.count_nonzero(pairs[1:] - pairs[:-1] - ((1 << 32) + 1)))


def plan_descriptors(
    plan: np.ndarray,
    remote_pools: Sequence[tuple[int, int]],
    local_pools: Sequence[tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """(remote, local) (address, length, device) lists of read_plan's rows."""
    remote, local = (np.array(pools, dtype=np.uint64) for pools in (remote_pools, local_pools))
    nbytes = plan[:, 4].astype(np.uint64)
    remote_descs = np.stack(
        [remote[plan[:, 0], 0] + plan[:, 1].astype(np.uint64), nbytes, remote[plan[:, 0], 1]],
        axis=1,
    )
    local_descs = np.stack(
        [local[plan[:, 2], 0] + plan[:, 3].astype(np.uint64), nbytes, local[plan[:, 2], 1]],
        axis=1,
    )
    return remote_descs, local_descs
