"""Torch reference of the greedy draw (greedy_triton.py), same signature: the CPU path and the oracle."""

from __future__ import annotations

import torch


def greedy_draw(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits float32 [R, V] -> (ids int64 [R]: each row's argmax, the first on ties as torch.argmax;
    logprobs float32 [R]: the id's log-probability; lse float32 [R]: the row's log-sum-exp)."""
    lse = torch.logsumexp(logits, dim=-1)
    ids = logits.argmax(dim=-1)
    return ids, logits.gather(1, ids[:, None]).squeeze(1) - lse, lse
