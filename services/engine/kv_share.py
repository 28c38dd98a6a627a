"""Rank 0 sees every rank's KV pool: the one NIXL agent of a tensor-parallel worker registers them all.

A follower's pool lives in memory rank 0 can map: on the CPU a file in /dev/shm that both
processes map (rank 0 unlinks it once mapped, so nothing outlives the processes); on a GPU the
follower's allocation, exported as a CUDA IPC handle through the ranks' store (JSON, no pickle).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch


def shared_file(prefix: str, rank: int) -> str:
    return f"{prefix}-r{rank}"


def allocate_shared(shape: tuple[int, ...], dtype: torch.dtype, path: str) -> torch.Tensor:
    """A zeroed CPU tensor backed by the file at path (created), which another process can map."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = np.memmap(path, dtype=np.uint8, mode="w+", shape=(nbytes,))
    return torch.from_numpy(memory).view(dtype).view(shape)


def map_shared(shape: tuple[int, ...], dtype: torch.dtype, path: str) -> torch.Tensor:
    """Maps a follower's file-backed pool and unlinks the file: the mapping keeps the memory alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
    os.unlink(path)
    return torch.from_numpy(memory).view(dtype).view(shape)


def export_cuda(kv_cache: torch.Tensor) -> str:
    """The CUDA IPC handle of a follower's pool, as JSON."""
    fields = kv_cache.untyped_storage()._share_cuda_()
    return json.dumps([f.hex() if isinstance(f, bytes) else f for f in fields])


def import_cuda(handle_json: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Opens a follower's pool from its exported handle (rank 0's view of the follower's GPU memory)."""
    raw = json.loads(handle_json)
    # (device, handle, size, offset, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
    fields = [bytes.fromhex(f) if index in (1, 4, 6) else f for index, f in enumerate(raw)]
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", fields[0]))
    return tensor.set_(storage, 0, shape)
