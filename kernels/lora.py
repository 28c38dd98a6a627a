"""Batched LoRA over a mixed batch (the S-LoRA / Punica scheme): torch reference.

Every token of a step may use a different adapter (or none). The adapters' low-rank
factors live in fixed pool tensors, one slot per adapter, and a layer's LoRA is two
batched products over the whole step, whatever the mix of adapters:

    shrink   buf[t]            = x[t] @ A[slot(t)]^T                 (rank-sized)
    expand   y[t, lo_s:hi_s]  += buf[t, s*R:(s+1)*R] @ B[slot(t), lo_s:hi_s]^T   per slice s

The tokens of the step are grouped by slot on the host (LoRAMetadata): segment s of
`token_order` lists the tokens of slot s, and tokens without an adapter are in no
segment, so they cost nothing and their rows of y are left alone. A fused projection
(q/k/v, gate/up) is one LoRA of several slices: A stacks the slices' A factors (R rows
each), B stacks their B factors along the output, and slice s of the output reads the
R columns of buf that slice s of A produced.

The shrink returns its result as partial sums [num_splits, T, N] in float32 (the Triton
kernel splits the reduction over K into deterministic partials; here num_splits is 1);
the expand adds them up, rounds the sum to the weights' dtype (as PEFT's lora_A output
is), and adds its product to y in float32 before one rounding to y's dtype. Rows of buf
outside every segment are never read: they may hold anything.

The adapter's scaling (alpha / r) is folded into B when the adapter is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAMetadata:
    """Which tokens of a step use which pool slot.

    token_order: int32 [T]: token indices grouped by slot (slot 0's first), then the
    tokens without an adapter. slot_starts: int32 [num_slots + 1]: segment s is
    token_order[slot_starts[s]:slot_starts[s + 1]]; slot_starts[num_slots] is the number
    of tokens that use an adapter.
    """

    token_order: torch.Tensor
    slot_starts: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.slot_starts.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.token_order.shape[0]

    @staticmethod
    def host_arrays(token_slots, num_slots: int):
        """(token_order, slot_starts) as numpy int32 for per-token slots (-1: no adapter)."""
        import numpy as np

        slots = np.asarray(token_slots, dtype=np.int64)
        if slots.size and (slots.max() >= num_slots or slots.min() < -1):
            raise ValueError(
                f"token slots must be in [-1, {num_slots}), got {sorted(set(slots.tolist()))}"
            )
        key = np.where(slots < 0, num_slots, slots)  # tokens without an adapter go last
        order = np.argsort(key, kind="stable").astype(np.int32)
        starts = np.searchsorted(key[order], np.arange(num_slots + 1), side="left").astype(np.int32)
        return order, starts

    @classmethod
    def build(cls, token_slots, num_slots: int, device: torch.device | str = "cpu") -> LoRAMetadata:
        order, starts = cls.host_arrays(token_slots, num_slots)
        return cls(torch.from_numpy(order).to(device), torch.from_numpy(starts).to(device))


def _segments(meta: LoRAMetadata):
    starts = meta.slot_starts.tolist()
    for slot in range(meta.num_slots):
        if starts[slot + 1] > starts[slot]:
            yield slot, meta.token_order[starts[slot] : starts[slot + 1]].long()


def lora_shrink(x: torch.Tensor, a_pool: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor:
    """x [T, K], a_pool [num_slots, N, K] -> partial sums [1, T, N] float32 of x[t] @ A[slot(t)]^T."""
    out = torch.zeros(1, x.shape[0], a_pool.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _segments(meta):
        out[0, rows] = x[rows].float() @ a_pool[slot].float().T
    return out


def lora_expand(
    buf: torch.Tensor,
    b_pool: torch.Tensor,
    meta: LoRAMetadata,
    y: torch.Tensor,
    slice_bounds: tuple[int, ...],
) -> None:
    """y[t, lo:hi] += round(buf[:, t, s*R:(s+1)*R].sum(0)) @ B[slot(t), lo:hi]^T for each slice s = (lo, hi)
    of slice_bounds (b_pool [num_slots, N_out, R], y [T, N_out]); in place."""
    rank = b_pool.shape[2]
    summed = buf.sum(0)
    for slot, rows in _segments(meta):
        for s, (lo, hi) in enumerate(zip(slice_bounds[:-1], slice_bounds[1:])):
            low_rank = summed[rows, s * rank : (s + 1) * rank].to(b_pool.dtype).float()
            delta = low_rank @ b_pool[slot, lo:hi].float().T
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
